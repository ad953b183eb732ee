"""The server layer: the ways in. The OpenAI-compatible HTTP app, its protocol and streaming,
tools, metrics, the data-parallel front, batch files, the terminal chat. Weeks 10, 11, 16, 18.
"""
