"""Text-classification experiments: the reference encoder classifier, data, the runner, the demo, reports.

Import-light: tokenizers, tqdm, matplotlib, safetensors and codecarbon are imported only when used.
"""

from condcomp.experiments.classification.model import PRESETS, EncoderClassifier, ModelConfig
from condcomp.experiments.classification.runconfig import RunConfig

__all__ = ["PRESETS", "EncoderClassifier", "ModelConfig", "RunConfig"]
