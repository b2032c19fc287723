"""The scoring plan (``coati_kto.trainer.scoring_plan``): which passes score a micro-batch and where z0 is reduced,
as a table of batch shape x rules -> plan, and the rules a trainer's options, models and backend give."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from coati_kto.data.batch import KTOBatch
from coati_kto.data.collator import KTOCollator
from coati_kto.models.lora import AdapterFreeReference
from coati_kto.testing.tiny import random_causal_lm
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.scoring_plan import ScoringPlan, ScoringRules


def _rows(
    seed: int, prompt: tuple[int, int], completion: tuple[int, int], cached: bool = False
) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi, (1,), generator=gen))
        return torch.randint(3, 60, (n,), generator=gen).tolist()

    rows = []
    for label in (1, 0, 1, 0):
        p = draw(*prompt)
        row = dict(input_ids=p + draw(*completion), completion_start=len(p), label=bool(label))
        row.update(kl_input_ids=p + draw(*completion), kl_completion_start=len(p))
        if cached:
            row.update(reference_logps=-1.0, reference_kl_logps=-2.0)
        rows.append(row)
    return rows


def _cut() -> list[dict]:
    """Long prompts, one KL prompt cut differently by truncation: no continuation, no fold."""
    rows = _rows(1, (14, 20), (1, 4))
    rows[2]["kl_input_ids"] = rows[2]["kl_input_ids"][1:]
    rows[2]["kl_completion_start"] -= 1
    return rows


BATCHES = {
    "long": lambda: KTOCollator(0)(_rows(0, (14, 20), (1, 4))),  # prompts >> completions: folding pays
    "short": lambda: KTOCollator(0)(_rows(0, (5, 8), (5, 8))),  # prompt ~ completion: two passes cheaper
    "cut": lambda: KTOCollator(0)(_cut()),
    "cached": lambda: KTOCollator(0)(_rows(0, (14, 20), (1, 4), cached=True)),
    "one_row": lambda: KTOCollator(0, padding_free="one")(_rows(0, (5, 8), (5, 8))),
    "bins_of_one": lambda: KTOCollator(0, padding_free="bins")(_rows(0, (5, 8), (5, 8))),
}
RULES = {
    "plain": ScoringRules(needs_kl=True),
    "fold": ScoringRules(needs_kl=True, policy_packs=True, folds=True),
    "pack_no_fold": ScoringRules(needs_kl=True, policy_packs=True),  # torch DDP: packs in evaluation only
    "continue": ScoringRules(needs_kl=True, continues=True),
    "both": ScoringRules(needs_kl=True, policy_packs=True, folds=True, continues=True),
    "pack_reference": ScoringRules(needs_kl=True, pack_reference=True, reference_packs=True),
    "continue_pack_reference": ScoringRules(needs_kl=True, continues=True, pack_reference=True),
    "apo": ScoringRules(needs_kl=False, policy_packs=False, continues=False),
    "no_loss_mask": ScoringRules(needs_kl=True, padding_free=False),
}
TRAIN, EVAL = "train", "eval"
ALONE, GROUPED = True, False

# rules, batch, train/eval, alone -> policy_kl, reference, z0 (example_rows / kl_rows: False unless shown)
TABLE = [
    ("plain", "long", TRAIN, ALONE, "separate", "separate", "group"),
    ("fold", "long", TRAIN, ALONE, "folded", "separate", "after_forward"),
    ("fold", "long", TRAIN, GROUPED, "separate", "separate", "group"),  # kl_scope step, accumulation 2
    ("fold", "short", TRAIN, ALONE, "separate", "separate", "group"),  # folding does not pay
    ("fold", "long", EVAL, GROUPED, "packed", "separate", "group"),
    ("pack_no_fold", "long", TRAIN, ALONE, "separate", "separate", "group"),
    ("pack_no_fold", "long", EVAL, GROUPED, "packed", "separate", "group"),
    ("continue", "long", TRAIN, ALONE, "continued", "continued", "after_forward"),
    ("continue", "long", TRAIN, GROUPED, "separate", "separate", "group"),
    ("continue", "long", EVAL, GROUPED, "continued", "continued", "group"),  # no gradient pass to wait for
    ("continue", "cut", TRAIN, ALONE, "separate", "separate", "group"),
    ("both", "long", TRAIN, ALONE, "folded", "separate", "after_forward"),  # folding first where it pays
    ("both", "short", TRAIN, ALONE, "continued", "continued", "after_forward"),
    ("both", "cut", TRAIN, ALONE, "separate", "separate", "group"),
    ("both", "short", EVAL, GROUPED, "packed", "separate", "group"),  # evaluation packs before it continues
    ("both", "cached", TRAIN, ALONE, "folded", "cached", "after_forward"),
    ("continue", "cached", TRAIN, ALONE, "continued", "cached", "after_forward"),
    ("pack_reference", "long", TRAIN, ALONE, "separate", "packed", "group"),
    ("continue_pack_reference", "short", TRAIN, ALONE, "continued", "continued", "after_forward"),
    ("continue_pack_reference", "cut", TRAIN, ALONE, "separate", "packed", "group"),
    ("apo", "long", TRAIN, ALONE, "none", "examples", "none"),
    ("apo", "long", EVAL, GROUPED, "none", "examples", "none"),
    ("apo", "cached", TRAIN, ALONE, "none", "cached", "none"),
]


@pytest.mark.parametrize("rules,batch,mode,alone,policy_kl,reference,z0", TABLE)
def test_plan_table(
    rules: str, batch: str, mode: str, alone: bool, policy_kl: str, reference: str, z0: str
) -> None:
    plan = RULES[rules].plan(BATCHES[batch](), train=mode == TRAIN, alone=alone)
    want = ScoringPlan(mode == TRAIN, policy_kl, reference, "model", z0)  # type: ignore[arg-type]
    assert plan == want
    assert plan.kl_late == (z0 == "after_forward")


@pytest.mark.parametrize(
    "rules,batch,rows",
    [
        ("plain", "one_row", True),  # one row of 4 documents per view
        ("plain", "bins_of_one", False),  # 4 bins of one document each: the padded view is the same work
        ("no_loss_mask", "one_row", False),  # rows score completions only; without the loss mask, every token
        ("plain", "long", False),  # the collator planned no rows
    ],
)
def test_padding_free_rows_where_they_are_fewer_than_the_batch(rules: str, batch: str, rows: bool) -> None:
    made = BATCHES[batch]()
    plan = RULES[rules].plan(made, train=True)
    assert (plan.example_rows, plan.kl_rows) == (rows, rows)
    assert plan.rows(made, kl=False) is (made.example_rows if rows else None)
    assert plan.rows(made, kl=True) is (made.kl_rows if rows else None)


def test_z0_of_a_group() -> None:
    """Once per group before the gradient passes (also an empty group: the other ranks enter the collective),
    unless the one micro-batch's KL log-probs come with its gradient forward, or the loss has no z0."""
    long = BATCHES["long"]()
    assert RULES["plain"].group_z0([]) and RULES["plain"].group_z0([RULES["plain"].plan(long, True, True)])
    assert not RULES["fold"].group_z0([RULES["fold"].plan(long, True, True)])
    assert not RULES["apo"].group_z0([])


def test_no_reference_model_and_no_cached_logps_is_refused() -> None:
    rules = ScoringRules(needs_kl=True, reference_model="none")
    assert rules.plan(BATCHES["cached"](), train=True).reference == "cached"
    with pytest.raises(
        ValueError, match="^no reference model and the batch has no precomputed reference_logps$"
    ):
        rules.plan(BATCHES["long"](), train=True)


def test_precompute_scores_the_reference_as_training_will() -> None:
    """``coati-kto precompute``: the reference's KL pairs folded (one shared-prompt pass) where the policy will
    fold, else continued where the model allows it, else one shared-prompt pass."""
    llama = random_causal_lm(LlamaForCausalLM, LlamaConfig, attn_implementation="sdpa")
    mistral = random_causal_lm(
        MistralForCausalLM, MistralConfig, attn_implementation="sdpa", sliding_window=6
    )  # a window: no continuation
    long, short = BATCHES["long"](), BATCHES["short"]()

    def reference(model: torch.nn.Module, batch: KTOBatch, continuation: bool, pack: bool) -> str:
        return ScoringRules.for_precompute(model, continuation, pack).plan(batch, True, True).reference

    assert reference(llama, long, True, True) == "packed"
    assert reference(llama, short, True, True) == "continued"
    assert reference(llama, long, True, False) == "continued"
    assert reference(llama, long, False, False) == "packed"
    assert reference(mistral, short, True, False) == "packed"


class _Boosted:
    """A booster's wrapper around a PeftModel, as ColossalAI's ``unwrap(unwrap_peft=...)`` answers."""

    def __init__(self, peft: torch.nn.Module) -> None:
        self.peft = peft

    def unwrap(self, unwrap_peft: bool = True) -> torch.nn.Module:
        return self.peft.get_base_model() if unwrap_peft else self.peft


def _rules(
    policy, reference, collectives: bool = False, tp: int = 1, mask: bool = True, **options
) -> ScoringRules:
    return ScoringRules.for_trainer(KTOOptions(**options), policy, reference, collectives, tp, mask)


def test_trainer_rules_from_options_models_and_backend() -> None:
    llama = random_causal_lm(LlamaForCausalLM, LlamaConfig, attn_implementation="sdpa")
    reference = random_causal_lm(LlamaForCausalLM, LlamaConfig, seed=1, attn_implementation="sdpa")
    eager = random_causal_lm(LlamaForCausalLM, LlamaConfig, attn_implementation="eager")
    flash = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    both = dict(pack_policy=True, kl_continuation=True)
    assert _rules(llama, reference, **both) == ScoringRules(
        True, True, True, True, False, False, True, "model"
    )
    # torch DDP's forward holds collectives: the evaluation still packs, training neither folds nor continues.
    assert _rules(llama, reference, collectives=True, **both) == ScoringRules(
        True, True, reference_model="model"
    )
    assert not _rules(llama, reference, tp=2, **both).continues  # a sharded forward's cache is not tested
    assert not _rules(llama, flash, **both).continues  # every model must continue (flash attention cannot)
    assert _rules(eager, None, **both).continues and _rules(eager, None).reference_model == "none"
    off = _rules(llama, reference, mask=False, pack_reference=True, **both)
    assert off == ScoringRules(True, padding_free=False)  # without the loss mask: every token, padded passes
    packed = _rules(llama, reference, pack_reference=True)
    assert packed.pack_reference and packed.reference_packs and not packed.policy_packs
    assert _rules(
        llama, reference, loss_type="apo_zero_unpaired", pack_reference=True, **both
    ) == ScoringRules(False)


def test_a_lora_runs_reference_is_its_policy_with_adapters_off() -> None:
    from peft import LoraConfig, get_peft_model

    llama = random_causal_lm(LlamaForCausalLM, LlamaConfig, attn_implementation="sdpa")
    policy = _Boosted(get_peft_model(llama, LoraConfig(r=2, target_modules=["q_proj"])))
    rules = _rules(policy, AdapterFreeReference(policy))
    assert rules.reference_model == "adapters_off" and rules.continues
    assert rules.plan(BATCHES["short"](), True, True).reference_model == "adapters_off"


def test_no_loss_mask_under_sequence_parallelism_is_refused() -> None:
    """Without the loss mask sp 1 scores every token (padded passes) while an sp pass always runs on the sliced
    padding-free rows, which score completions only: a silent difference, refused in one line."""
    llama = random_causal_lm(LlamaForCausalLM, LlamaConfig, attn_implementation="sdpa")
    with pytest.raises(ValueError) as err:
        ScoringRules.for_trainer(KTOOptions(), llama, None, False, 1, False, 2)
    assert str(err.value) == (
        "apply_loss_mask=False with sp_size 2: sequence-parallel passes run on the sliced padding-free rows, which "
        "score the completion tokens only (sp_size 1 would score every token): set apply_loss_mask=True, or "
        "sp_size 1"
    )
    assert ScoringRules.for_trainer(KTOOptions(), llama, None, False, 1, True, 2).padding_free
