"""Compression to 2:4 sparse INT8 encoder weights with distillation. By default (`--method oneshot`): a dense
teacher, then a one-shot projection onto 2:4 ∩ INT8 (masks by |w|·‖x‖^0.5, the kept weights updated by OBS,
SparseGPT's), then QAT with distillation; the default does not use ADMM. ADMM is opt-in: `--method admm`,
`--method admm_guided`, `--set projection=admm`, `--set projection=admm_fixed_mask` and `--set
projection=admm_stable`. None is the default because none measured better after training, paired by seed with it
(docs/results/2026-11-28-admm-decisive.md); the layer-wise ADMM projection is offered for its closer fit to each
layer's outputs before training (docs/design.md)."""
