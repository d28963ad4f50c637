"""GRPO: inference servers, an actor and a trainer joined by a sample stream (docs/DESIGN.md, "The GRPO pipeline
contract")."""
