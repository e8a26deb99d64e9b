"""tlt_core: fused tree speculative-decoding kernels and the pieces of an adaptive rollout
loop for RL of reasoning language models.

`tlt_core.ops` is the public kernel API (torch, NumPy and CuPy arrays in, same kind out);
`tlt_core.ops.reference` is its pure-PyTorch oracle.
"""

__version__ = "0.1.0"
