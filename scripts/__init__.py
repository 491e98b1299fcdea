"""Operations scripts: network emulator, launchers, SSH batch control.

Run as files (`python scripts/tc.py ...`) or as console entry points (setup.py)."""
