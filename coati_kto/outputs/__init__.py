"""What a run leaves behind: the trained model in Hugging Face format (``weights.py``), its model card
(``model_card.py``), the upload to the Hub (``push.py``) and ``coati-kto export``'s checks and paths (``export.py``).
The recipes (``coati_kto.recipe``) call these once training or loading is done; no training step reads them."""
