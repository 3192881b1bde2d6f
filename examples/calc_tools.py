"""The agent demo's tool (`make demo-agent`), written as a TRL 1.16 user writes one for
GRPOTrainer(tools=[multiply]): a plain function with type hints and a docstring; its JSON schema
comes from transformers' get_json_schema."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
