"""Write the example configurations where they are checked in, from vsup/config/schema.py and
vsup/config/tune_settings.py: vsup/config/data/vsup.yaml (`vsup config --example`;
configs/vsup.yaml links to it; the wheel ships it for `install-systemd`), the
`vsup config --example --all` block of docs/configuration.md (the reference) and the
`vsup config --tune-settings` block of docs/tune.md. Run it after changing a key, a default or a
description:

    .venv/bin/python scripts/config_reference.py

tests/test_example_config.py fails until the files match the model."""

from __future__ import annotations

from pathlib import Path

from vsup.config.example import example_yaml, with_reference, with_tune_settings

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    example = ROOT / "vsup" / "config" / "data" / "vsup.yaml"
    reference = ROOT / "docs" / "configuration.md"
    tune = ROOT / "docs" / "tune.md"
    for path, text in ((example, example_yaml()), (reference, with_reference(reference.read_text())),
                       (tune, with_tune_settings(tune.read_text()))):
        if path.read_text() != text:
            path.write_text(text)
            print(f"{path.relative_to(ROOT)}: rewritten")
        else:
            print(f"{path.relative_to(ROOT)}: already up to date")


if __name__ == "__main__":
    main()
