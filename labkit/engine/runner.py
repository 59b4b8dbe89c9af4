"""The model runner: one step's packed forward pass over the paged cache, and sampling.

It turns a `StepPlan` into tensors (the new tokens of every scheduled sequence side by
side, their positions, their slots), performs the plan's copy-on-write block copies,
calls the model once through the backend's cache view, and samples one token for each
sequence the engine asks for, beside the forward pass: what comes back is token ids, not
logits. Every sequence samples from its own (seed, step) stream, so its tokens do not
depend on which other sequences share the step.
"""

from __future__ import annotations

import torch

from labkit.engine.interfaces import Backend, KVPoolLike, ServedModel
from labkit.engine.scheduler import StepPlan
from labkit.engine.sequence import Sequence
from labkit.sampling import sample_batch


class ModelRunner:
    def __init__(self, model: ServedModel, pool: KVPoolLike, backend: Backend):
        self.model, self.pool, self.backend = model, pool, backend
        self.device = pool.device

    @torch.inference_mode()
    def run(self, plan: StepPlan, samples: list[tuple[Sequence, Sequence]]) -> list[int]:
        """Run the plan's tokens through the model; return one token for each pair
        (row owner, sample) of `samples`. The owner is a scheduled sequence whose tokens this
        step completes; the sample is it, or a sibling forked from it (n > 1), which draws
        from the same logits with its own seed."""
        self.pool.copy_blocks(plan.copies)
        ids, tables, starts, counts, row_of = [], [], [], [], {}
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
                row_of[seq.seq_id] = len(row_of), row - 1
        batch = self.backend.batch(self.pool, tables, starts, counts)
        rows = torch.tensor([r for _, r in row_of.values()], dtype=torch.long, device=self.device)
        logits = self.model(torch.tensor([ids], device=self.device), cache=batch, rows=rows)[0]
        if not samples:
            return []
        picks = [row_of[owner.seq_id][0] for owner, _ in samples]
        if picks != list(range(len(row_of))):
            logits = logits[torch.tensor(picks, dtype=torch.long, device=logits.device)]
        return self.sample([seq for _, seq in samples], logits)

    @staticmethod
    def sample(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        if not seqs:
            return []
        if all(s.params.greedy and s.params.repetition_penalty == 1.0 for s in seqs):
            # What sample_batch returns for greedy rows (the argmax, lowest id on ties),
            # without building the one-hot distributions.
            return logits.argmax(dim=-1).tolist()
        seen = [seq.token_ids if seq.params.repetition_penalty != 1.0 else None for seq in seqs]
        return sample_batch(logits.cpu(), [s.params for s in seqs], [s.sampling_seed for s in seqs],
                            [len(s.output_token_ids) for s in seqs], seen)
