"""The Solver-Verifier-Corrector system: roles, parsing, model clients, the inference
loop, grouped training rollouts and the `marsrl solve` / `marsrl eval` commands."""
