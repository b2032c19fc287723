"""The families whose KL pass may continue from the examples' KV cache (coati_kto.models.continuation)."""

# Families whose KL pass continues from the examples' KV cache exactly as a separate pass scores it
# (coati_kto.models.continuation): every type tests/distributed/continuation_sweep.py found exact (fp32, 1e-4
# nats per sequence) on 2026-11-27 with transformers 5.24, and Mistral without a window (its default has one:
# tests/distributed/test_kl_continuation.py). Not exact there, so never continued: MPT (0.1 nats), Doge
# (0.06); failing: Bloom, Falcon, CPM-Ant, HRM. DBRX, DeepSeek-V2, dots1, HunYuan (dense, MoE), LongCat-Flash
# and Nemotron are exact since the tiny builder completes their configs (the same day). A family's structure
# alone does not tell: a wrong continuation would go unseen in training (policy and reference share it, step-1
# KL stays 0).
CONTINUATION_FAMILIES = frozenset(
    """
apertus apertus1p5_text arcee aria_text axk1 bitnet codegen cohere ctrl dbrx deepseek_v2 deepseek_v3 diffllama
dots1 ernie4_5 ernie4_5_moe exaone flex_olmo gemma git glm glm4 glm4_moe glm4_moe_lite gpt-sw3 gpt2
gpt_bigcode gpt_neo gpt_neox gpt_neox_japanese gptj granite granitemoe granitemoeshared helium
hunyuan_v1_dense hunyuan_v1_moe hy_v3 hyperclovax internlm3 iquestcoder jais2 jetmoe laguna lfm2 llama
longcat_flash mellum minicpm3 minimax_m2 minimax_m3_vl_text ministral3 mistral mixtral nanochat nemotron olmo
olmo2 olmoe persimmon phi phi3 phi4_multimodal phimoe qwen2 qwen2_moe qwen3 qwen3_moe sarvam_mla sarvam_moe
seed_oss smollm3 solar_open stablelm starcoder2 whisper xglm youtu
""".split()  # noqa: SIM905 (a list literal of 78 names would be 78 lines)
)
