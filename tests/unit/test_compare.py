"""gates/judge/compare.py on synthetic probe tensors: statistics grow with the perturbation, ids are matched, NaN is seen."""

from __future__ import annotations

import numpy as np
import pytest

from skupin.gates.judge.compare import CompareError, kernel_errors, model_statistics, nonfinite_tensors


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def probe_tensors(logits: np.ndarray, hidden: np.ndarray, ids: np.ndarray, *, k: int = 8, full: int = 2) -> dict:
    """The probe's model.* tensors for given logits [P, T+1, V] (positions 0..T-1 predict ids 1..T)."""
    lp = _log_softmax(logits[:, :-1].astype(np.float64)).astype(np.float32)
    order = np.argsort(-lp, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(lp, order, -1)
    target = np.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0]
    greedy = logits[:, -1:].argmax(-1).repeat(4, 1).astype(np.int32)
    return {
        "model.input_ids": ids.astype(np.int32),
        "model.topk_ids": order.astype(np.int32),
        "model.topk_logprobs": top,
        "model.target_logprob": target.astype(np.float32),
        "model.hidden": hidden.astype(np.float32),
        "model.logprobs_full": lp[:full],
        "model.greedy_ids": greedy,
    }


def synthetic(seed: int = 0, prompts: int = 12, positions: int = 10, vocab: int = 64, width: int = 16):
    """(logits, hidden, ids) of a fake model; logits are a fixed projection of the hidden states."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((prompts, positions + 1, width))
    head = rng.standard_normal((width, vocab)) * 0.8
    ids = rng.integers(0, vocab, size=(prompts, positions + 1))
    return hidden, head, ids


def candidate(hidden, head, ids, noise: float, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    h = hidden + noise * rng.standard_normal(hidden.shape)
    return probe_tensors(h @ head, h, ids)


@pytest.fixture()
def model():
    return synthetic()


def test_identical_outputs_have_zero_distance(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    stats = model_statistics(ref, dict(ref))
    for name in ("kl", "one_minus_cos", "logprob_l2", "max_abs"):
        assert np.all(stats.per_prompt[name] == 0), name
    assert np.all(stats.per_prompt["top1_agree"] == 1)
    assert stats.nonfinite == ()
    assert stats.greedy_same == 1.0
    assert set(stats.available) >= {"kl", "kl_full", "one_minus_cos", "logprob_l2", "max_abs"}


def test_every_statistic_grows_with_the_perturbation(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    small = model_statistics(ref, candidate(hidden, head, ids, 1e-4))
    large = model_statistics(ref, candidate(hidden, head, ids, 1e-1))
    for name in ("kl", "kl_full", "one_minus_cos", "logprob_l2", "max_abs"):
        assert 0 < small.mean(name) < large.mean(name) / 100, name
    assert large.mean("top1_agree") <= small.mean("top1_agree")


def test_topk_kl_does_not_exceed_the_full_kl(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    stats = model_statistics(ref, candidate(hidden, head, ids, 5e-2))
    full = stats.per_prompt["kl_full"][:2]
    assert np.all(stats.per_prompt["kl"][:2] <= full * (1 + 1e-6))


def test_candidate_topk_is_matched_by_id_not_position(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    cand = candidate(hidden, head, ids, 1e-3)
    perm = np.random.default_rng(3).permutation(cand["model.topk_ids"].shape[-1])
    shuffled = {**cand, "model.topk_ids": cand["model.topk_ids"][..., perm],
                "model.topk_logprobs": cand["model.topk_logprobs"][..., perm]}
    a, b = model_statistics(ref, cand), model_statistics(ref, shuffled)
    for name in ("kl", "logprob_l2", "max_abs"):
        np.testing.assert_allclose(a.per_prompt[name], b.per_prompt[name], rtol=1e-12)


def test_a_constant_normalisation_error_does_not_count_as_kl(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    shifted = {**ref, "model.logprobs_full": ref["model.logprobs_full"] + np.float32(3e-6)}
    assert np.all(model_statistics(ref, shifted).per_prompt["kl_full"][:2] < 1e-12)


def test_nan_in_the_candidate_is_reported_not_hidden(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    cand = candidate(hidden, head, ids, 1e-3)
    cand["model.hidden"][3, 2, 1] = np.nan
    stats = model_statistics(ref, cand)
    assert "model.hidden" in stats.nonfinite
    assert "model.hidden" in nonfinite_tensors(cand)


def test_other_prompts_cannot_be_compared(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    other = {**ref, "model.input_ids": ref["model.input_ids"] + 1}
    with pytest.raises(CompareError, match="other prompts"):
        model_statistics(ref, other)


def test_missing_hidden_states_are_a_note_not_a_zero(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    cand = {k: v for k, v in candidate(hidden, head, ids, 1e-2).items() if k != "model.hidden"}
    stats = model_statistics(ref, cand)
    assert "one_minus_cos" not in stats.available
    assert np.isnan(stats.per_prompt["one_minus_cos"]).all()
    assert stats.notes


def test_kernel_errors_are_scale_normalised_and_explain_problems():
    ref = {"kernels.a.float32": np.array([[2.0, -4.0]], np.float32), "kernels.b.float32": np.ones(3, np.float32),
           "kernels.c.float32": np.ones(2, np.float32), "kernels.d.float32": np.ones(2, np.float32)}
    cand = {"kernels.a.float32": np.array([[2.0, -3.0]], np.float32), "kernels.b.float32": np.ones(4, np.float32),
            "kernels.d.float32": np.array([1.0, np.inf], np.float32)}
    results = {r.op: r for r in kernel_errors(ref, cand)}
    assert results["a.float32"].rel_err == pytest.approx(0.25)
    assert "shape" in results["b.float32"].problem
    assert "did not produce" in results["c.float32"].problem
    assert not results["d.float32"].finite


@pytest.mark.parametrize("name, value", [
    ("model.logprobs_full", np.float32(0.0).reshape(())),  # rank 0: used to raise IndexError
    ("model.logprobs_full", np.zeros(0, np.float32)),  # used to raise ValueError (empty max)
    ("model.logprobs_full", np.zeros((4, 0), np.float32)),
    ("model.logprobs_full", np.zeros((0, 10, 64), np.float32)),  # no prompt at all: kl_full silently lost
    ("model.logprobs_full", np.zeros((3, 10, 64), np.float32)),  # more prompts than the reference stored
    ("model.logprobs_full", np.zeros((2, 10, 63), np.float32)),
    ("model.logprobs_full", np.zeros((2, 10, 64), np.int32)),
    ("model.hidden", np.zeros((12, 11, 15), np.float32)),  # used to drop 1 - cos with a note
    ("model.hidden", np.zeros((12, 11, 16), np.bool_)),
    ("model.topk_ids", np.zeros((12, 10, 8), np.float32)),
    ("model.topk_logprobs", np.zeros((12, 10, 8), np.int64)),
    ("model.target_logprob", np.zeros((12, 10, 1), np.float32)),
    ("model.greedy_ids", np.zeros((12, 5), np.int32)),
    ("model.input_ids", np.zeros((12,), np.int32)),
])
def test_a_misshaped_candidate_tensor_is_a_compare_error_naming_it(model, name, value):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    cand = {**candidate(hidden, head, ids, 1e-3), name: value}
    with pytest.raises(CompareError, match=name.replace(".", r"\.")):
        model_statistics(ref, cand)


def test_a_candidate_may_store_full_logprobs_for_fewer_prompts_than_the_reference(model):
    hidden, head, ids = model
    ref = probe_tensors(hidden @ head, hidden, ids)
    cand = candidate(hidden, head, ids, 1e-3)
    cand["model.logprobs_full"] = cand["model.logprobs_full"][:1]
    stats = model_statistics(ref, cand)
    assert "kl_full" in stats.available
    assert np.isfinite(stats.per_prompt["kl_full"][0]) and np.isnan(stats.per_prompt["kl_full"][1:]).all()


def test_a_kernel_output_of_another_kind_is_a_problem_not_a_number():
    ref = {"kernels.a.float32": np.ones(2, np.float32)}
    results = kernel_errors(ref, {"kernels.a.float32": np.ones(2, np.bool_)})
    assert results[0].rel_err is None and "dtype" in results[0].problem


def _ragged(tensors: dict, lengths: np.ndarray, fill: float) -> dict:
    """`tensors` of a ragged prompt set: every position past a prompt's length set to `fill` (0 for ids)."""
    out = dict(tensors)
    seq = tensors["model.input_ids"].shape[1]
    tok = np.arange(seq)[None, :] < lengths[:, None]
    pos = tok[:, 1:]
    for name, valid in (("model.topk_logprobs", pos), ("model.target_logprob", pos), ("model.hidden", tok)):
        value = tensors[name].copy()
        value[~valid] = fill
        out[name] = value
    ids = tensors["model.topk_ids"].copy()
    ids[~pos] = 0
    out["model.topk_ids"], out["model.logprobs_full"] = ids, tensors["model.logprobs_full"].copy()
    out["model.logprobs_full"][~pos[: ids.shape[0]][: out["model.logprobs_full"].shape[0]]] = fill
    inputs = tensors["model.input_ids"].copy()
    inputs[~tok] = 0
    out["model.input_ids"] = inputs
    out["model.prompt_lengths"] = lengths.astype(np.int32)
    return out


def test_ragged_prompts_are_judged_on_their_own_positions_only(model):
    hidden, head, ids = model
    lengths = np.array([11, 4, 7, 11, 2, 9, 11, 5, 6, 10, 3, 8])
    ref = _ragged(probe_tensors(hidden @ head, hidden, ids), lengths, 0.0)
    # what a candidate writes in the padding changes nothing (finite values)
    junk = _ragged(probe_tensors(hidden @ head, hidden, ids), lengths, 3.0)
    stats = model_statistics(ref, junk)
    assert all(np.all(stats.per_prompt[s] == 0) for s in ("kl", "one_minus_cos", "logprob_l2", "max_abs"))
    assert np.all(stats.per_prompt["top1_agree"] == 1)
    # a change inside one prompt's positions shows in that prompt only; a short prompt's mean is over its own positions
    moved = dict(junk)
    moved["model.target_logprob"] = junk["model.target_logprob"].copy()
    moved["model.target_logprob"][4, 0] -= 0.5  # prompt 4 has 2 ids: one predicted position
    stats = model_statistics(ref, moved)
    assert stats.per_prompt["max_abs"][4] == pytest.approx(0.5) and stats.per_prompt["max_abs"][np.arange(12) != 4].max() == 0
    assert stats.per_prompt["logprob_l2"][4] == pytest.approx(0.5, rel=1e-6)  # one position: its own L2, not 0.5 / 10


@pytest.mark.parametrize("lengths, words", [
    (None, "model.prompt_lengths differ"),
    (np.array([11, 4, 7, 11, 2, 9, 11, 5, 6, 10, 3, 9]), "model.prompt_lengths differ"),
])
def test_a_candidate_with_other_prompt_lengths_cannot_be_compared(model, lengths, words):
    hidden, head, ids = model
    mine = np.array([11, 4, 7, 11, 2, 9, 11, 5, 6, 10, 3, 8])
    ref = _ragged(probe_tensors(hidden @ head, hidden, ids), mine, 0.0)
    cand = dict(ref)
    if lengths is None:
        del cand["model.prompt_lengths"]
    else:
        cand["model.prompt_lengths"] = lengths.astype(np.int32)
    with pytest.raises(CompareError, match=words):
        model_statistics(ref, cand)


def test_prompt_lengths_that_do_not_fit_the_inputs_are_refused(model):
    hidden, head, ids = model
    bad = np.array([12, 4, 7, 11, 2, 9, 11, 5, 6, 10, 3, 8])  # longer than model.input_ids
    ref = _ragged(probe_tensors(hidden @ head, hidden, ids), np.minimum(bad, 11), 0.0)
    ref["model.prompt_lengths"] = bad.astype(np.int32)
    with pytest.raises(CompareError, match="does not fit model.input_ids"):
        model_statistics(ref, dict(ref))
