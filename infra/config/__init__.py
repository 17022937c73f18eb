"""The run configuration: pydantic sections, parsing, the placement plan, the generated reference."""
