"""The model zoo: where prepared models live, and how they are made."""
