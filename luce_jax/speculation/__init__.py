"""Speculative decoding: proposers (prompt lookup, a draft model), the policy that decides
how many proposals each slot verifies, and the speculator the engine calls."""
