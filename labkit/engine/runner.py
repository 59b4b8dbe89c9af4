"""The model runner: one step's packed forward pass over the paged cache, then sampling.

It turns a `StepPlan` into tensors (the new tokens of every scheduled sequence side by
side, their positions, their slots), performs the plan's copy-on-write block copies,
calls the model once, and samples one token for each sequence whose tokens are now all
computed. Every sequence samples from its own (seed, step) stream, so its tokens do not
depend on which other sequences share the step.
"""

from __future__ import annotations

import torch

from labkit.engine.paged_cache import KVPool, PagedBatch
from labkit.engine.scheduler import StepPlan
from labkit.engine.sequence import Sequence
from labkit.sampling import sample_batch


class ModelRunner:
    def __init__(self, model, pool: KVPool):
        self.model, self.pool = model, pool

    @torch.inference_mode()
    def logits(self, plan: StepPlan) -> tuple[list[Sequence], torch.Tensor]:
        """(sequences to sample for, their next-token logits [len, vocab])."""
        self.pool.copy_blocks(plan.copies)
        ids, tables, starts, counts, rows, sampled = [], [], [], [], [], []
        row = 0
        for item in plan.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            tables.append(seq.block_table)
            starts.append(start)
            counts.append(n)
            row += n
            if item.completes:
                rows.append(row - 1)
                sampled.append(seq)
        batch = PagedBatch(self.pool, tables, starts, counts)
        logits = self.model(torch.tensor([ids]), cache=batch, rows=torch.tensor(rows, dtype=torch.long))
        return sampled, logits[0]

    @staticmethod
    def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        if not seqs:
            return []
        if all(s.params.greedy and s.params.repetition_penalty == 1.0 for s in seqs):
            # What sample_batch returns for greedy rows (the argmax, lowest id on ties),
            # without building the one-hot distributions.
            return logits.argmax(dim=-1).tolist()
        seen = [seq.token_ids if seq.params.repetition_penalty != 1.0 else None for seq in seqs]
        return sample_batch(logits, [s.params for s in seqs], [s.sampling_seed for s in seqs],
                            [len(s.output_token_ids) for s in seqs], seen)
