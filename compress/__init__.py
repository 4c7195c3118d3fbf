"""Compression to 2:4 sparse INT8 encoder weights with distillation. By default (`--method oneshot`): a dense
teacher, then a one-shot projection onto 2:4 ∩ INT8 (masks by |w|·‖x‖^0.5, the kept weights updated by OBS,
SparseGPT's), then QAT with distillation. ADMM is opt-in: `--method admm`, `--method admm_guided`,
`--set projection=admm`, `--set projection=admm_fixed_mask` and `--set projection=admm_stable` (why none is the
default: docs/design.md)."""
