"""Engine v0 and the CLI: greedy output equals transformers' generate, token for token up to
the near-tie rule (two implementations of one model: `conftest.assert_greedy_near`)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import (GGUF_LOGIT_ERROR, PROMPTS, SMOL_LOGIT_ERROR, assert_greedy_near, greedy_reference_scores,
                      hf_greedy_scores, needs_kernels)
from labkit.engine.loop import generate
from labkit.sampling import SamplingParams

NEW_TOKENS = 24


@pytest.mark.parametrize("prompt", PROMPTS[:5])
def test_greedy_matches_transformers_generate(model, reference, prompt):
    ours = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    theirs, scores = hf_greedy_scores(reference, ours.prompt_token_ids, NEW_TOKENS)
    assert_greedy_near([theirs], [ours.token_ids], [scores], SMOL_LOGIT_ERROR, what="labkit against transformers")
    assert ours.text == model.tokenizer.decode(ours.token_ids)


def test_chat_prompt_matches_transformers_generate(model, reference):
    ours = generate(model, "Name three planets.", SamplingParams(temperature=0.0, max_tokens=40),
                    chat=True)
    assert ours.prompt_token_ids[:3] == model.tokenizer.encode("<|im_start|>system\n")
    theirs, scores = hf_greedy_scores(reference, ours.prompt_token_ids, 40)
    agreement = assert_greedy_near([theirs], [ours.token_ids], [scores], SMOL_LOGIT_ERROR,
                                   what="labkit against transformers")
    if agreement.exact:  # (after an excused near-tie the answers are other texts)
        assert ours.finish_reason == "stop"  # the model ends its answer with <|im_end|>


def test_repeated_greedy_runs_are_identical(model):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    runs = {tuple(generate(model, PROMPTS[0], params).token_ids) for _ in range(3)}
    assert len(runs) == 1


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    def run(seed):
        return generate(model, PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=12,
                                                          seed=seed)).token_ids
    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_stop_string_spanning_tokens_cuts_the_text(model):
    free = generate(model, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12))
    stop = free.text[3:9]  # a stop string that starts inside one token and ends in another
    cut = generate(model, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.index(stop)]


def test_streamed_pieces_never_hold_a_stop_string_that_spans_tokens(model):
    """What a stream sends cannot be taken back: the pieces of a sample cut by a stop string
    that spans tokens add up to the cut text, not to the text before its last token."""
    free = generate(model, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12))
    stop = free.text[3:9]
    pieces = []
    cut = generate(model, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,)),
                   on_text=pieces.append)
    assert "".join(pieces) == cut.text == free.text[:free.text.index(stop)]


def test_streamed_pieces_concatenate_to_the_text(model):
    pieces = []
    result = generate(model, "Emoji: 🎉🚀 and 東京", SamplingParams(temperature=0.0, max_tokens=16),
                      on_text=pieces.append)
    assert "".join(pieces) == result.text
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in result.text


def test_timings_cover_every_stage(model):
    result = generate(model, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6))
    t = result.timings
    assert len(t.decode_steps) == len(result.token_ids) - 1
    assert t.total >= t.tokenize + t.prefill + t.decode
    assert all(x > 0 for x in [t.tokenize, t.prefill, *t.decode_steps])


def test_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, "", SamplingParams(temperature=0.0))


# the default weights ("gguf") and "gguf-int8" run on labkit's C kernels; where they do not
# load, the fallback is tested below (test_cli_falls_back_to_f32_where_the_default_cannot_run)
@needs_kernels
def test_cli_json(model):
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "generate", PROMPTS[0], "--max-tokens", "5", "--json"],
        capture_output=True, text=True, check=True)
    record = json.loads(out.stdout)
    expected = generate(model, PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5))
    assert record["weights"] == "gguf"  # the default: the file's blocks, float32's greedy tokens
    assert record["prompt_token_ids"] == expected.prompt_token_ids
    # the file's blocks against float32 (whose loop is greedy_reference's path): up to a near-tie
    want, scores = greedy_reference_scores(model, expected.prompt_token_ids, len(expected.token_ids))
    assert want == expected.token_ids
    agreement = assert_greedy_near([want], [record["token_ids"]], [scores], GGUF_LOGIT_ERROR,
                                   what="`labkit generate` on the file's blocks against float32")
    if agreement.exact:
        assert record["text"] == expected.text
    assert record["timings"]["prefill"] > 0


@needs_kernels
def test_cli_generates_on_the_files_blocks(model):
    """`--weights gguf-int8` runs the block model with activations rounded to 8 bits: its
    tokens are that model's, and on this prompt they part from float32's within 16 tokens."""
    from labkit.engine.backends import backend_for

    prompt, params = "The capital of France is", SamplingParams(temperature=0.0, max_tokens=16)
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "generate", prompt, "--max-tokens", "16",
                          "--json", "--weights", "gguf-int8"], capture_output=True, text=True, check=True)
    rounded = generate(backend_for(True, "gguf-int8").prepare(model), prompt, params).token_ids
    assert json.loads(out.stdout)["token_ids"] == rounded != generate(model, prompt, params).token_ids


def test_cli_falls_back_to_f32_where_the_default_cannot_run(model):
    """Without the C kernels (LABKIT_NATIVE=0) the default "gguf" cannot run: the command
    says so and generates on float32 weights; asked for by name, it is an error."""
    env = {**os.environ, "LABKIT_NATIVE": "0"}
    command = [sys.executable, "-m", "labkit.cli", "generate", PROMPTS[0], "--max-tokens", "3", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout)["weights"] == "f32" and "using f32 weights" in out.stderr
    named = subprocess.run([*command, "--weights", "gguf"], capture_output=True, text=True, env=env)
    assert named.returncode == 2 and "C kernels" in named.stderr


def test_cli_rejects_bad_sampling_options():
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "generate", "hi", "--top-p", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "top_p" in out.stderr


def test_cli_model_info_accounts_for_every_byte():
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "model", "info", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    g = info["gguf"]
    parts = ["header_bytes", "tokenizer_bytes", "other_metadata_bytes", "tensor_info_bytes",
             "alignment_padding_bytes", "tensor_bytes"]
    assert sum(g[p] for p in parts) == g["file_bytes"] == 98_362_432
    assert g["alignment_padding_bytes"] >= 0
    assert info["parameters"] == g["parameters_stored"] == 134_515_008
