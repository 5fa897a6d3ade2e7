"""The contracts between an adapter and the rest of ff: plain data a family declares or exchanges, importable from here.

- :mod:`~ff_core.contracts.io` — the IO contract vocabulary (:class:`PipelineIOContract`: input media, slots,
  references, ordered outputs with fps and sample rate, batch and CFG policy);
- :mod:`~ff_core.contracts.geometry` — the target geometry an adapter encodes (:class:`MediaGeometry`,
  :class:`AudioSpan`) and a video family's default clip (:class:`ClipDefaults`);
- :mod:`~ff_core.contracts.tensor_columns` — where its inputs are stored in tensor-parquet rows
  (:class:`TensorColumns`);
- :mod:`~ff_core.contracts.latents` — what it exchanges in memory (:class:`LatentState`, ``Condition``,
  :class:`ConditionInput`).

Nothing here loads weights or imports an adapter: datasets are checked against these before a GPU is touched.
"""

from ff_core.contracts.geometry import (
    FRAME_RULES,
    AudioSpan,
    ClipDefaults,
    FrameRule,
    MediaGeometry,
)
from ff_core.contracts.io import (
    AUDIO_OUT,
    IMAGE_OUT,
    VIDEO_OUT,
    GroupSpec,
    MediaType,
    NegativePrompt,
    OutputSpec,
    PipelineIOContract,
    ReferenceSpec,
    SlotSpec,
)
from ff_core.contracts.latents import (
    Condition,
    ConditionInput,
    LatentState,
)
from ff_core.contracts.tensor_columns import (
    LATENT_BATCH_KEYS,
    TensorColumns,
)

__all__ = [
    "AUDIO_OUT",
    "FRAME_RULES",
    "IMAGE_OUT",
    "LATENT_BATCH_KEYS",
    "VIDEO_OUT",
    "AudioSpan",
    "ClipDefaults",
    "Condition",
    "ConditionInput",
    "FrameRule",
    "GroupSpec",
    "LatentState",
    "MediaGeometry",
    "MediaType",
    "NegativePrompt",
    "OutputSpec",
    "PipelineIOContract",
    "ReferenceSpec",
    "SlotSpec",
    "TensorColumns",
]
