"""OpenAI's own code beside the port: its shims, its runs recorded, their replay (tests/replays/test_oai_replay.py)."""
