"""The embedded default workload: a synthetic reasoning task with heavy-tailed response lengths,
a tiny model pre-trained on it, and that model's drafter, all made by the project itself (no
model or data set is downloaded).

`task.py` is the task (countdown sums mod 100, worked one line per step) with its tokenizer and
checker; `architecture.py` the model's shape; `pretrain_data.py` and `pretrain.py` its
supervised pre-training; `offline_drafter.py` its drafter's training on the model's own
responses; `workload.py` the one loader (`load_embedded`, `train_inputs`) and where the weights
come from (shipped, cached, or trained now). Only tlt_core.bench and tlt_core.cli import this
package: the toolkit below it works on any model.
"""

from tlt_core.embedded.architecture import EMBEDDED_MODEL_CONFIG
from tlt_core.embedded.offline_drafter import (OfflineDrafterConfig, OfflineDrafterReport,
                                               train_offline_drafter)
from tlt_core.embedded.pretrain import (PretrainConfig, PretrainReport, evaluate, pretrain,
                                        sample_responses)
from tlt_core.embedded.task import (CharTokenizer, Problem, TaskConfig, check_answer,
                                    generate_problems, length_stats, parse_answer)
from tlt_core.embedded.workload import (EmbeddedWorkload, cache_root, drafter_folder_name,
                                        embedded_reward, load_drafter, load_embedded,
                                        load_pretrained, model_folder_name,
                                        train_default_weights, train_inputs)

__all__ = ["CharTokenizer", "EMBEDDED_MODEL_CONFIG", "EmbeddedWorkload", "OfflineDrafterConfig",
           "OfflineDrafterReport", "PretrainConfig", "PretrainReport", "Problem", "TaskConfig",
           "cache_root", "check_answer", "drafter_folder_name", "embedded_reward", "evaluate",
           "generate_problems", "length_stats", "load_drafter", "load_embedded",
           "load_pretrained", "model_folder_name", "parse_answer", "pretrain",
           "sample_responses", "train_default_weights", "train_inputs", "train_offline_drafter"]
