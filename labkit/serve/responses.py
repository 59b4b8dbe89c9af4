"""OpenAI's response bodies, built from the engine's outputs and events.

Completions (`text_completion`) and chat completions (`chat.completion`, streamed as
`chat.completion.chunk`) each have their own shape for a choice, its logprobs and a
stream's chunks; `usage` is shared. Choice `index` runs over prompts, then samples:
prompt p's sample i is choice p * n + i, as in OpenAI's API.

Token strings in logprobs are the token's own bytes decoded as UTF-8 (a token that ends
inside a multi-byte character shows U+FFFD there); chat logprobs also give the exact `bytes`.
"""

from __future__ import annotations

from functools import lru_cache

from labkit.engine.llm_engine import RequestOutput
from labkit.tokenizer import bytes_to_unicode


class TokenText:
    """A token id's bytes and text, for logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self.byte_level = getattr(getattr(tokenizer, "meta", None), "tokenizer_model", None) == "gpt2"
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        spelled = self.tokenizer.id_to_token(token_id) or ""
        if self.byte_level and token_id not in self.tokenizer.special_token_ids \
                and all(c in self._byte_of for c in spelled):
            return bytes(self._byte_of[c] for c in spelled)
        return spelled.encode("utf-8")

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def usage(outputs: list[RequestOutput], n_prompts_tokens: int | None = None) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs) if n_prompts_tokens is None else n_prompts_tokens
    completion = sum(len(s.token_ids) for o in outputs for s in o.samples)
    cached = sum(o.cached_prompt_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- logprobs -----------------------------------------------------------------------------

def completion_logprobs(tokens: TokenText, token_ids, logprobs, tops, text_start: int = 0) -> dict:
    """The legacy completions shape: parallel lists, one dict of alternatives per token."""
    texts = [tokens.text(t) for t in token_ids]
    offsets, at = [], text_start
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": list(logprobs),
            "top_logprobs": [{tokens.text(t): lp for t, lp in top} for top in tops],
            "text_offset": offsets}


def chat_logprobs(tokens: TokenText, token_ids, logprobs, tops) -> dict:
    def entry(token_id, logprob):
        return {"token": tokens.text(token_id), "logprob": logprob, "bytes": list(tokens.bytes(token_id))}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top]}
                        for t, lp, top in zip(token_ids, logprobs, tops)],
            "refusal": None}


# -- whole responses ----------------------------------------------------------------------

def completion_body(response_id: str, created: int, model: str, outputs: list[RequestOutput], n: int,
                    tokens: TokenText | None, echo: list[str] | None = None) -> dict:
    """`echo`: each prompt's text, which its choices' texts then begin with (OpenAI's `echo`)."""
    choices = []
    for p, output in enumerate(outputs):
        for sample in output.samples:
            logprobs = None
            if tokens is not None:
                logprobs = completion_logprobs(tokens, sample.token_ids, sample.logprobs, sample.top_logprobs)
            text = sample.text if echo is None else echo[p] + sample.text
            choices.append({"index": p * n + sample.index, "text": text, "logprobs": logprobs,
                            "finish_reason": sample.finish_reason})
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage(outputs)}


def chat_body(response_id: str, created: int, model: str, output: RequestOutput,
              tokens: TokenText | None, replies=None) -> dict:
    """`replies` (labkit.serve.openai_tools.ChatToolReplies) reads each choice's text for tool
    calls: its message and finish reason replace the plain ones."""
    choices = []
    for sample in output.samples:
        logprobs = None
        if tokens is not None:
            logprobs = chat_logprobs(tokens, sample.token_ids, sample.logprobs, sample.top_logprobs)
        message = {"role": "assistant", "content": sample.text, "refusal": None}
        reason = sample.finish_reason
        if replies is not None:
            message, reason = replies.message(sample.text, reason)
        choices.append({"index": sample.index, "message": message, "logprobs": logprobs,
                        "finish_reason": reason})
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage([output])}


# -- stream chunks ------------------------------------------------------------------------

def completion_chunk(response_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(response_id: str, created: int, model: str, index: int, delta: dict,
               finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(response_id: str, created: int, model: str, obj: str, outputs: list[RequestOutput]) -> dict:
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(outputs)}
