"""Answer matching (math-verify) and the agent-specific rewards built on it."""
