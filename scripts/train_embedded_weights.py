"""Trains the embedded model and its drafter from scratch with the default configs and writes
them, with their provenance, in the layout tlt_core ships them in:

    python scripts/train_embedded_weights.py tlt_core/embedded/weights

OUT/<model folder>/ holds the model (a Hugging Face checkpoint) and its pre-training report,
OUT/<model folder>/<drafter folder>/ the drafter and its report, OUT/PROVENANCE.json how they were
made (configs, reports, versions, machine, commit). About 10 minutes on 2 CPU cores. The folder
names are digests of the configs (tlt_core.embedded.workload), so weights for other configs
never shadow these.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tlt_core.embedded.workload import PROVENANCE_FILE, train_default_weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write (tlt_core/embedded/weights to "
                                               "replace the shipped weights)")
    args = parser.parse_args()
    existing = [p for p in args.out.glob("embedded-*")] if args.out.is_dir() else []
    if existing:
        raise SystemExit(f"out: {args.out} already holds {existing[0].name}; remove it first "
                         "(these weights are never overwritten in place)")
    args.out.mkdir(parents=True, exist_ok=True)
    provenance = train_default_weights(args.out)
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, cwd=root).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "tlt_core"],
                                    capture_output=True, text=True, check=True,
                                    cwd=root).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    provenance["git_commit"] = commit
    provenance["git_tlt_core_modified"] = dirty
    (args.out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")
    print(f"wrote {args.out / provenance['drafter']['folder']} and {args.out / PROVENANCE_FILE}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
