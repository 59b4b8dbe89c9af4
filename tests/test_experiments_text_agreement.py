"""The near-tie rule for a served text: where an answer leaves the reference's tokens, which
token it took, and whether the reference's gap there is within the tolerance."""

from conftest import tied_reference_run
from labkit.experiments import text_agreement as ta

PIECES = ["", " the", " cat", " sat", " on", " mat", " a", " dog", " the cat"]


class Pieces:
    """A tokenizer whose token i is PIECES[i]."""

    def decode(self, ids):
        return "".join(PIECES[i] for i in ids)


def _reference(tokens, near=None):
    """Each reference token leads by 5, except at `near` (step, rival, gap)."""
    return tied_reference_run(tokens, len(PIECES), Pieces().decode(tokens), near)


def test_the_same_text_is_exact():
    ref = _reference([1, 2, 3])
    got = ta.text_agreement(Pieces(), ref, " the cat sat", 2e-3)
    assert got.exact and got.ok


def test_a_flip_at_a_near_tie_is_excused_and_named():
    ref = _reference([1, 2, 3, 4], near=(1, 7, 1e-4))   # " cat" leads " dog" by 1e-4
    got = ta.text_agreement(Pieces(), ref, " the dog sat on", 2e-3)
    assert got.excused and got.diverged_at == 1
    assert (got.reference_token, got.candidate_token) == (2, 7)
    assert abs(got.margin - 1e-4) < 1e-6


def test_a_flip_at_a_wide_gap_fails():
    ref = _reference([1, 2, 3], near=(1, 7, 0.5))
    got = ta.text_agreement(Pieces(), ref, " the dog sat", 2e-3)
    assert not got.ok and got.candidate_token == 7 and got.margin == 0.5


def test_a_text_no_top_token_explains_fails():
    ref = _reference([1, 2, 3])
    got = ta.text_agreement(Pieces(), ref, " the bird", 2e-3, top_k=4)
    assert not got.ok and got.diverged_at == 1 and got.candidate_token is None


def test_a_truncated_or_longer_text_fails():
    ref = _reference([1, 2, 3])
    assert not ta.text_agreement(Pieces(), ref, " the cat", 2e-3).ok
    assert not ta.text_agreement(Pieces(), ref, " the cat sat on", 2e-3).ok


def test_a_summary_counts_the_excused():
    refs = [_reference([1, 2]), _reference([1, 2], near=(1, 7, 1e-4))]
    summary = ta.texts_agreement(Pieces(), refs, [" the cat", " the dog"], 2e-3)
    assert summary.ok and summary.exact == 1 and summary.excused == 1


def test_a_cut_off_text_agrees_as_a_prefix_only_when_asked():
    ref = _reference([1, 2, 3, 4])
    assert not ta.text_agreement(Pieces(), ref, " the cat", 2e-3).ok
    got = ta.text_agreement(Pieces(), ref, " the cat", 2e-3, prefix=True)
    assert got.exact and got.length == 2
    near = _reference([1, 2, 3, 4], near=(1, 7, 1e-4))
    assert ta.text_agreement(Pieces(), near, " the dog", 2e-3, prefix=True).excused
