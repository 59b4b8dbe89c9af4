"""Structured outputs: response formats, grammar matchers and the masks they give the sampler.

`contract` holds what the engine asks of a grammar engine; `llg` is the llguidance backend
the engine uses; `json_fsm` is chapter 35's hand-written automaton for a JSON subset, held to
llguidance by the tests.
"""

from labkit.structured.contract import (GrammarMatcher, InvalidFormat, ResponseFormat, bitmask_words,
                                        pack_bitmask, unpack_bitmask)

__all__ = ["GrammarMatcher", "InvalidFormat", "ResponseFormat", "bitmask_words", "pack_bitmask",
           "unpack_bitmask"]
