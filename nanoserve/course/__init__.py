"""The course machinery. Imports no nanoserve code: `stubs` is copied into every learner's
workspace; `workspace` makes and checks workspaces (`nanoserve course ...`).
"""
