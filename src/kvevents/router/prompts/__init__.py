"""Prompts from request bodies: token bodies, completion bodies and tokenizing."""
