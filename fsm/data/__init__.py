"""Rows coming in: dataset files read as rows (files) and each row normalised and checked once, where it enters
(rows: the trust boundary for data). Imports nothing else of fsm.
"""
