"""The GRPO trainer kind and everything of it.

Generation through the shared decode, shared policy passes, and a gang's turns.
"""
