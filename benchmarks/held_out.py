"""The held-out split: fixed once (2026-12-01), recorded here, and used by no design decision.

Every quality claim (the packaged calibrations' held-out figures, the README's rows, the SQuAD
pages) is measured on it, beside its lower bound:

- SQuAD v1.1 dev: its questions drawn by ``SQUAD_SEED`` (``quality.squad.retrieval_examples``).
  Its 48 articles are not SQuAD train's, which calibration probes and prompts are designed on.
- the package's generated task (``training.data.make_examples``) on ``GENERATED_SEED``, a seed no
  run had used. The seed that held the generated task out before, ``quality.DEVELOPMENT_SEED``,
  chose the selections calibration tries (the oracle benchmark's questions are its first 12), so
  it is development data now.

What design decisions may use: SQuAD train, ``quality.DEVELOPMENT_SEED`` (the oracle, probes,
quality and codecs benchmarks) and ``calibration.CALIBRATION_SEED`` (calibration's own probes).
"""

from blend_integrations.quality import squad

SQUAD_SPLIT = "dev"
SQUAD_SEED = 75
GENERATED_SEED = 50_000
# the seed SQuAD train's calibration probes and the prompt design draw from (tuning reads none of its text)
SQUAD_TRAIN_SEED = squad.DESIGN_SEED
