"""systemd: the unit (unit.py), its installer (install.py), sd_notify (notify.py)."""
