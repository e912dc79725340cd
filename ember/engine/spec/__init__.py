"""Speculative decoding: proposers draft tokens, the target model verifies them in the next step.

The engine's step stays the one step: a decoding request that carries drafted tokens is fed its
last token and its drafts in one chunk, the scheduler pays for them like any other tokens, and the
runner draws each position's token exactly as plain decoding would (engine.runner), keeping the
drafts as far as they agree. This package proposes: `Speculator` asks a proposer (n-gram lookup
or a draft model) for each decoding request's drafts and tunes how many to ask for. A draft model
also works inside that step (spec.draft_model): it drafts once the scheduler has granted the rounds,
and prefills the step's prompt chunks into its own entries of the same blocks.
"""
