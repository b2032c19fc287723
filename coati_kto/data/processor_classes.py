"""The processor classes of :mod:`coati_kto.data.processors` (Gemma 4's and Qwen 3.5's, without a video processor).

Apart from it because defining them imports ``transformers.processing_utils`` and both families' processing
modules (about 0.4 CPU-seconds): a process that meets no image record never imports this module.
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


# model type -> the processor class image records load for it (keys: coati_kto.data.processors.HUB_CLASS).
IMAGE_PROCESSING: dict[str, type[ProcessorMixin]] = {
    "gemma4": Gemma4ImageProcessing,
    "qwen3_5": Qwen3VLImageProcessing,
}
