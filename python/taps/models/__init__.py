"""Models: the target (HF causal LM, SmolLM2 by default) and the DFlash drafter."""
from taps.models.drafter import (DFlashConfig, DFlashDrafter, DFlashState, check_compatible,  # noqa: F401
                                 default_target_layer_ids, extract_context_features, load_drafter)
from taps.models.target import apply_chat_template, load_target  # noqa: F401
