"""The course machinery. Imports no nanoserve code: `stubs` is copied into every learner's
workspace; `workspace` makes workspaces, `exercise_map` knows which tests check which exercise,
`check` runs them, and `cli` is `nanoserve course ...`.
"""
