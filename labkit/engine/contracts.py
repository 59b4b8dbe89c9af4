"""The engine's parts and the typed contracts between them.

Engine v0 (``labkit.engine.loop.generate``) is five parts with narrow interfaces::

    text --TokenizerLike.encode--> ids --LogitsModel(ids, cache=...)--> logits
         --Sampler(logits, params, seed=, step=, seen_token_ids=)--> token id
         ... repeated by the Loop ... --TokenizerLike.decode--> text,
    all recorded in a Generation (token ids, text, finish reason, StageTimings).

Each contract below is a ``typing.Protocol``: any object with the right methods satisfies it,
whatever its class, so a part can be replaced (a transformers model for our Llama, say) without
the loop changing. The method signatures are written exactly as the loop calls them:
parameters before ``/`` are passed by position, all others by keyword.

``isinstance(obj, Protocol)`` (the protocols are ``runtime_checkable``) only asks whether the
names exist. :func:`conforms` also asks whether every call the loop makes would bind to the
object's signatures, and whether attributes that are themselves parts (``EngineModel.tokenizer``)
conform. Neither looks at behaviour: that is the job of the reference checks in
:mod:`labkit.experiments.part_checks`.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from labkit.engine.loop import Generation
from labkit.sampling import SamplingParams

__all__ = [
    "TokenizerLike",
    "LogitsModel",
    "EngineModel",
    "Sampler",
    "Loop",
    "PROTOCOLS",
    "conformance_problems",
    "conforms",
    "TransformersAdapter",
]


@runtime_checkable
class TokenizerLike(Protocol):
    """Text to token ids and back. The loop also needs the end-of-sequence id to stop on.

    ``decode`` must accept ``skip_special_tokens`` by keyword: the streaming detokenizer
    passes it. (``encode_chat`` is used only for ``chat=True`` and is not part of the contract.)
    """

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, /) -> list[int]: ...

    def decode(self, ids: Sequence[int], /, *, skip_special_tokens: bool = False) -> str: ...


@runtime_checkable
class LogitsModel(Protocol):
    """The model: token ids ``[batch, seq]`` to logits ``[batch, seq or 1, vocab]``.

    With a ``cache`` (made by ``new_cache``) the call appends the new positions to it and
    attends over everything cached before; ``last_only=True`` returns only the last position's
    logits (prefill needs no others). The cache's type is the backend's own business.
    """

    def __call__(self, input_ids: torch.Tensor, /, *, cache: Any = None,
                 last_only: bool = False) -> torch.Tensor: ...

    def new_cache(self, *, batch: int, max_len: int) -> Any: ...


@runtime_checkable
class EngineModel(LogitsModel, Protocol):
    """What ``generate`` takes: a backend that carries its tokenizer."""

    tokenizer: TokenizerLike


@runtime_checkable
class Sampler(Protocol):
    """One sequence's ``[vocab]`` logits to one token id.

    The token must depend only on the logits, the params, the tokens seen so far and the
    pair ``(seed, step)``: that is what makes a seeded request reproducible.
    """

    def __call__(self, logits: torch.Tensor, params: SamplingParams, /, *, seed: int | None,
                 step: int, seen_token_ids: Sequence[int] | None = None) -> int: ...


@runtime_checkable
class Loop(Protocol):
    """Prompt (text or ids) to a :class:`~labkit.engine.loop.Generation` record."""

    def __call__(self, model: EngineModel, prompt: str | list[int],
                 params: SamplingParams | None = None, /, *, chat: bool = False,
                 on_text: Callable[[str], None] | None = None) -> Generation: ...


PROTOCOLS = {"tokenizer": TokenizerLike, "backend": LogitsModel, "engine model": EngineModel,
             "sampler": Sampler, "loop": Loop}

_VAR_POS, _VAR_KW = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD


def _members(protocol: type) -> dict[str, Any]:
    """Name -> the protocol's own definition (function, property, or annotation) of each member."""
    members: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Protocol, typing.Generic) or not getattr(klass, "_is_protocol", False):
            continue
        hints = typing.get_type_hints(klass)
        for name in klass.__dict__.get("__annotations__", {}):
            members[name] = hints.get(name, Any)
        for name, value in klass.__dict__.items():
            if name.startswith("_") and name != "__call__":
                continue  # typing's bookkeeping (_is_protocol, __module__, ...), not members
            members[name] = value
    return members


def _signature(obj: Any, name: str) -> inspect.Signature | None:
    """The signature a call of ``obj.<name>`` binds to; None where Python cannot tell."""
    target = obj if name == "__call__" else getattr(obj, name)
    if name == "__call__" and isinstance(obj, torch.nn.Module):
        target = obj.forward  # Module.__call__ is (*args, **kwargs); forward says what it takes
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def _calls(proto_sig: inspect.Signature) -> list[tuple[list, dict]]:
    """The two calls a caller may make under the protocol: required arguments only, and all."""
    params = [p for p in proto_sig.parameters.values() if p.name != "self"]
    calls = []
    for with_optional in (False, True):
        args, kwargs = [], {}
        for p in params:
            if p.default is not inspect.Parameter.empty and not with_optional:
                continue
            if p.kind is inspect.Parameter.POSITIONAL_ONLY:
                args.append(object())
            elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                kwargs[p.name] = object()
        calls.append((args, kwargs))
    return calls


def _swallowed(sig: inspect.Signature, bound: inspect.BoundArguments) -> list[str]:
    """Arguments that only reach ``*args`` or ``**kwargs``. Such an argument is accepted and may
    be ignored (a misspelt keyword would pass unnoticed), so it does not count as accepted."""
    out = []
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is _VAR_POS and value:
            out.append(f"*{name} takes {len(value)} positional argument(s)")
        elif kind is _VAR_KW and value:
            out.append(f"**{name} takes " + ", ".join(f"{k}=" for k in value))
    return out


def conformance_problems(obj: Any, protocol: type) -> list[str]:
    """Why ``obj`` does not satisfy ``protocol`` (empty list: it does).

    Checks that every member exists; that every method accepts both the call with only the
    required arguments and the call with all of them, passed the way the protocol's signature
    says (by position before ``/``, by keyword after); and, for attributes annotated with
    another protocol, that the attribute conforms to it.
    """
    problems: list[str] = []
    for name, spec in _members(protocol).items():
        if name != "__call__" and not hasattr(obj, name):
            problems.append(f"missing {name}")
            continue
        if name == "__call__" and not callable(obj):
            problems.append("not callable")
            continue
        if isinstance(spec, property):
            continue
        if inspect.isfunction(spec):
            sig = _signature(obj, name)
            if sig is None:
                continue  # a builtin without a signature: cannot tell, do not guess
            for args, kwargs in _calls(inspect.signature(spec)):
                shown = ", ".join(["<arg>"] * len(args) + [f"{k}=" for k in kwargs])
                try:
                    bound = sig.bind(*args, **kwargs)
                except TypeError as err:
                    problems.append(f"{name}({shown}) does not bind to {name}{sig}: {err}")
                    break
                swallowed = _swallowed(sig, bound)
                if swallowed:
                    problems.append(f"{name}({shown}): {'; '.join(swallowed)} (not a named parameter)")
                    break
        elif isinstance(spec, type) and getattr(spec, "_is_protocol", False):
            problems += [f"{name}: {p}" for p in conformance_problems(getattr(obj, name), spec)]
    return problems


def conforms(obj: Any, protocol: type) -> bool:
    """True when ``obj`` satisfies ``protocol`` by name and by call signature."""
    return isinstance(obj, protocol) and not conformance_problems(obj, protocol)


class TransformersAdapter:
    """Adapter: a ``transformers`` causal LM as a :class:`LogitsModel` (and, with a tokenizer,
    an :class:`EngineModel`), so engine v0's loop runs on it unchanged.

    The cache is transformers' ``DynamicCache`` (it grows, so ``max_len`` is not needed);
    ``last_only`` maps to ``logits_to_keep=1``; the output object is reduced to its logits.
    """

    def __init__(self, model: Any, tokenizer: TokenizerLike | None = None):
        self.model = model
        self.tokenizer = tokenizer

    def new_cache(self, *, batch: int = 1, max_len: int = 2048) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache: Any = None, last_only: bool = False) -> torch.Tensor:
        # transformers >= 5.2x names the cache argument `cache`; older versions `past_key_values`.
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids, use_cache=cache is not None, logits_to_keep=1 if last_only else 0,
                         **{name: cache})
        return out.logits
