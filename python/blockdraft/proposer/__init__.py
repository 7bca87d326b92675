"""The DFlash proposer (the contract class :class:`DFlashProposer`) and its parts.

| module | concept |
| --- | --- |
| ``proposer`` | the contract: states, commit, propose, verify, free |
| ``state`` | one sequence's state (:class:`DFlashState`) and one proposal over many |
| ``spec`` | what is read from the drafter, checked |
| ``commit`` | verified rows into the accumulators, as the core plans |
| ``run`` | one proposal from its plans to its drafts (graph path where it applies); ``num_drafts`` and bitmask checks |
| ``draft`` | drafts for many sequences by whichever path fits each (:meth:`DFlashProposer.draft`) |
| ``forward`` | the draft forward (:class:`DraftForward`), shared by both paths |
| ``fast`` | the fused view of a DFlash drafter the graph path runs (:class:`FastDrafter`) |
| ``graphs`` | its CUDA-graph replay (:class:`GraphRunner`) |
"""

from __future__ import annotations

from blockdraft.proposer.draft import Drafts
from blockdraft.proposer.forward import DraftForward
from blockdraft.proposer.graphs import GraphRunner
from blockdraft.proposer.pool import agreed_pool_size
from blockdraft.proposer.proposer import DFlashProposer
from blockdraft.proposer.state import DFlashState, Proposal

__all__ = ["DFlashProposer", "DFlashState", "DraftForward", "Drafts", "GraphRunner", "Proposal", "agreed_pool_size"]
