"""Processors for the families whose hub processor lists a video processor (Gemma 4, Qwen 3.5), built without one.

transformers' video processors need torchvision, which the project does not install (docs/image_feedback_plan.md
§9 step 0), so ``AutoProcessor`` cannot load these checkpoints. Image records need only the image processor (its
PIL flavour, what ``AutoImageProcessor`` gives without torchvision), the tokenizer and the chat template. The
classes here are the family's own processor whose ``__init__`` declares no ``video_processor``: transformers
derives a processor's parts from that signature (``ProcessorMixin.get_attributes``), so ``from_pretrained`` loads
the other parts from the checkpoint's files, tokenizes and expands images as the family's processor does, and
has no ``video_processor`` attribute (videos are refused). They are used for these families whatever is
installed, so that prepare and train always tokenize through the same class.
"""

from __future__ import annotations

from typing import Any

from transformers import Gemma4Processor, ProcessorMixin, Qwen3VLProcessor


class _NoVideo(ProcessorMixin):
    """Drops the ``video_processor`` (None) the family's ``__init__`` hands on: the subclass declares none."""

    def __init__(self, *args: Any, video_processor: Any = None, **kwargs: Any) -> None:
        parts = self.get_attributes()
        if video_processor is not None or any(a is not None for a in args[len(parts) :]):
            raise ValueError(f"{type(self).__name__} takes no video processor")
        super().__init__(*args[: len(parts)], **kwargs)


class Gemma4ImageProcessing(Gemma4Processor, _NoVideo):
    """``Gemma4Processor`` without a video processor: its feature extractor, image processor and tokenizer."""

    def __init__(
        self,
        feature_extractor: Any,
        image_processor: Any,
        tokenizer: Any,
        chat_template: str | None = None,
        image_seq_length: int = 280,
        audio_seq_length: int = 750,
        audio_ms_per_token: int = 40,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            feature_extractor,
            image_processor,
            tokenizer,
            None,
            chat_template=chat_template,
            image_seq_length=image_seq_length,
            audio_seq_length=audio_seq_length,
            audio_ms_per_token=audio_ms_per_token,
            **kwargs,
        )


class Qwen3VLImageProcessing(Qwen3VLProcessor, _NoVideo):
    """``Qwen3VLProcessor`` (Qwen 3.5's) without a video processor: its image processor and tokenizer."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


# model type -> the processor class image records load for it (any other: AutoProcessor).
IMAGE_PROCESSING: dict[str, type[ProcessorMixin]] = {
    "gemma4": Gemma4ImageProcessing,
    "qwen3_5": Qwen3VLImageProcessing,
}
# The processor class each of them stands for (what the checkpoint's processor_config.json names).
HUB_CLASS: dict[str, str] = {"gemma4": "Gemma4Processor", "qwen3_5": "Qwen3VLProcessor"}


def load_processor_for_images(path: str, trust_remote_code: bool = False) -> Any:
    """``path``'s processor for image records: the class of :data:`IMAGE_PROCESSING` for its model type, else
    ``AutoProcessor``'s. Raises what the load raises (OSError, ValueError, ImportError)."""
    from transformers import AutoConfig, AutoProcessor

    try:
        model_type = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type
    except (OSError, ValueError, KeyError):
        model_type = None
    if model_type in IMAGE_PROCESSING:
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
