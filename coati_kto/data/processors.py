"""Processors for the families whose hub processor lists a video processor (Gemma 4, Qwen 3.5), built without one.

transformers' video processors need torchvision, which the project does not install (docs/image_feedback_plan.md
§9 step 0), so ``AutoProcessor`` cannot load these checkpoints. Image records need only the image processor (its
PIL flavour, what ``AutoImageProcessor`` gives without torchvision), the tokenizer and the chat template. The
classes (``processor_classes.py``) are the family's own processor whose ``__init__`` declares no ``video_processor``: transformers
derives a processor's parts from that signature (``ProcessorMixin.get_attributes``), so ``from_pretrained`` loads
the other parts from the checkpoint's files, tokenizes and expands images as the family's processor does, and
has no ``video_processor`` attribute (videos are refused). They are used for these families whatever is
installed, so that prepare and train always tokenize through the same class.
"""

from __future__ import annotations

from typing import Any

# The model types whose image records load a class of coati_kto.data.processor_classes (any other:
# AutoProcessor), and the processor class each stands for (what the checkpoint's processor_config.json names).
HUB_CLASS: dict[str, str] = {"gemma4": "Gemma4Processor", "qwen3_5": "Qwen3VLProcessor"}


def load_processor_for_images(path: str, trust_remote_code: bool = False) -> Any:
    """``path``'s processor for image records: the class of ``processor_classes.IMAGE_PROCESSING`` for its model
    type, else ``AutoProcessor``'s. Raises what the load raises (OSError, ValueError, ImportError)."""
    from transformers import AutoConfig, AutoProcessor

    try:
        model_type = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type
    except (OSError, ValueError, KeyError):
        model_type = None
    if model_type in HUB_CLASS:
        from coati_kto.data.processor_classes import IMAGE_PROCESSING

        return IMAGE_PROCESSING[model_type].from_pretrained(path)
    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


def image_token_counts(outputs: Any, image_processor: Any, fixed: int | None) -> list[int]:
    """The image tokens of each image the image processor returned ``outputs`` for: Gemma 4's
    ``num_soft_tokens_per_image``, Qwen's grid (t·h·w / merge_size²), else ``fixed`` each (Gemma 3's
    ``image_seq_length``). ValueError where none of them is given."""
    if "num_soft_tokens_per_image" in outputs:
        return [int(n) for n in outputs["num_soft_tokens_per_image"]]
    if "image_grid_thw" in outputs:
        merge = int(image_processor.merge_size) ** 2
        return [int(grid.prod()) // merge for grid in outputs["image_grid_thw"]]
    if fixed is None:
        raise ValueError("the image processor gives no token count per image and no image_seq_length is set")
    return [fixed] * len(outputs["pixel_values"])


def pan_and_scan(processor: Any) -> bool:
    """Whether ``processor`` asks for Gemma 3's pan-and-scan crops: its image processor's ``do_pan_and_scan``
    (preprocessor_config.json; the collator calls the image processor alone) or the processor's own default (what
    prepare's expansion passes). Image records take one tower input per image, so either is refused."""
    own = getattr(processor, "images_kwargs", None) or {}
    return bool(getattr(processor.image_processor, "do_pan_and_scan", None) or own.get("do_pan_and_scan"))
