"""Anthropic's Messages API over the chat completion machinery (routes translate, engines compute)."""
