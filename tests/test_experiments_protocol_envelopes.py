"""Chapter 31's envelope experiments against transformers' apply_chat_template: the defended
ids of an ordinary conversation and the token counts of each envelope option are transformers'
own; for the attack texts, the naive ids are exactly what transformers' tokenize=True gives
(it is the naive path), and the defended ids hold no more role boundaries than a clean turn."""

import pytest

from labkit.experiments import protocol_envelopes as pe
from labkit.models.registry import fetch
from labkit.protocols.templates import ChatEncoder, published_template
from labkit.tokenizer import Tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models():
    from test_tokenizer_gemma3 import gemma3_gguf

    transformers = pytest.importorskip("transformers")
    smol_path, gemma_path = fetch("smollm2-135m"), gemma3_gguf()
    gemma_template = published_template("gemma3")
    ours = {"smollm2-135m": Tokenizer.from_gguf(smol_path),
            "gemma3-270m": Tokenizer.from_gguf(gemma_path).with_chat_template(gemma_template)}
    hf = {name: transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
          for name, p in (("smollm2-135m", smol_path), ("gemma3-270m", gemma_path))}
    templates = {"smollm2-135m": None, "gemma3-270m": gemma_template}
    return ours, hf, templates


def hf_ids(hf, template, messages, add_generation_prompt=True):
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                       chat_template=template, return_dict=False))


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_envelope_counts_are_transformers_lengths(models, model):
    ours, hf, templates = models
    counts = pe.envelope_counts(ours[model], pe.CONVERSATION)
    no_system = [m for m in pe.CONVERSATION if m["role"] != "system"]
    assert counts["rendered"] == len(hf_ids(hf[model], templates[model], pe.CONVERSATION))
    assert counts["no_generation_prompt"] == len(hf_ids(hf[model], templates[model], pe.CONVERSATION, False))
    assert counts["no_system"] == len(hf_ids(hf[model], templates[model], no_system))
    contents = sum(len(hf[model].encode(m["content"], add_special_tokens=False)) for m in pe.CONVERSATION)
    assert counts["content"] == contents
    text = hf[model].apply_chat_template(pe.CONVERSATION, tokenize=False, add_generation_prompt=True,
                                         chat_template=templates[model])
    assert counts["added_by_tokenizer"] == (len(hf[model].encode(text, add_special_tokens=True))
                                            - len(hf[model].encode(text, add_special_tokens=False)))


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_special_tokens_listed_are_the_template_markers(models, model):
    ours, hf, templates = models
    ids = ChatEncoder(ours[model]).encode(pe.CONVERSATION)
    assert ids == hf_ids(hf[model], templates[model], pe.CONVERSATION)
    listed = pe.special_tokens_of(ours[model], ids)
    assert [i for _, i, _ in listed] == [i for i in ids if i in set(hf[model].all_special_ids)
                                         or hf[model].convert_ids_to_tokens(i) in pe.BOUNDARIES[model]]
    assert all(ids[p] == i and hf[model].convert_ids_to_tokens(i) == s for p, i, s in listed)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_attacks_forge_boundaries_only_on_the_naive_path(models, model):
    ours, hf, templates = models
    trials = pe.forgery_trials(ours[model], model, pe.attack_texts(model))
    boundary_ids = {hf[model].convert_tokens_to_ids(s) for s in pe.BOUNDARIES[model]}
    for trial in trials:
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": trial.attack}]
        reference = hf_ids(hf[model], templates[model], messages)
        assert trial.naive_ids == reference
        assert trial.naive_boundaries == sum(i in boundary_ids for i in reference) > trial.clean_boundaries
        assert trial.defended_boundaries == trial.clean_boundaries
        # the defended ids decode back to exactly the text the template rendered
        text = hf[model].apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             chat_template=templates[model])
        assert ours[model].decode(trial.defended_ids) == text


def test_every_model_has_eight_distinct_attacks():
    for model in pe.ATTACKS:
        texts = pe.attack_texts(model)
        assert len(set(texts)) == len(texts) == 8
        assert all(any(s in t for s in pe.BOUNDARIES[model]) for t in texts)


def test_obedience_margin_matches_the_engines_own_logprobs():
    """word_logprob (one forward over prompt + word) against the engine's per-token logprobs
    (prefill, then decode steps through the KV cache): two computations of the same numbers."""
    import labkit
    from labkit.engine import EngineConfig, LLMEngine
    from labkit.sampling import SamplingParams

    model = labkit.load_model("smollm2-135m")
    tok = model.tokenizer
    prompt = ChatEncoder(tok).encode(pe.conversation_with(pe.attack_texts("smollm2-135m", 1)[0]))
    engine = LLMEngine(model, EngineConfig(kv_cache_tokens=1024))
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    sample = engine.generate([prompt], params)[0].samples[0]
    assert pe.word_logprob(model, prompt, sample.token_ids) == pytest.approx(sum(sample.logprobs), abs=1e-3)
    canary, answer = tok.encode_batch([pe.CANARY, pe.ANSWER], parse_special=False)
    margin = pe.obedience_margin(model, tok, prompt)
    by_word = pe.word_logprob(model, prompt, canary) - pe.word_logprob(model, prompt, answer)
    assert margin == pytest.approx(by_word)


def test_plain_arm_and_verdict():
    for model in pe.ATTACKS:
        for text in pe.attack_texts(model):
            plain = pe.without_markers(text, model)
            assert pe.INSTRUCTION in plain and not any(s in plain for s in pe.BOUNDARIES[model])
    assert [pe.verdict(*i) for i in ((0.1, 0.5), (-0.5, -0.1), (-0.1, 0.1))] == [
        "more", "less", "no measurable difference"]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_token_kinds_split_the_envelope(models, model):
    """The figure's colouring: its control ids are the listed special tokens, and its content
    ids are as many as the messages' texts tokenized on their own."""
    ours, _, _ = models
    ids = ChatEncoder(ours[model]).encode(pe.CONVERSATION)
    kinds = pe.token_kinds(ours[model], ids)
    listed = [i for _, i, _ in pe.special_tokens_of(ours[model], ids)]
    assert [i for i, k in zip(ids, kinds) if k == "control"] == listed
    # Gemma's template joins the system text to the first user text with "\n\n" inside the
    # turn; token_kinds cannot tell that separator from the content, so it counts one more.
    joined = 1 if model == "gemma3-270m" else 0
    assert kinds.count("content") == pe.content_tokens(ours[model], pe.CONVERSATION) + joined
