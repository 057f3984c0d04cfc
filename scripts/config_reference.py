"""Write the configuration reference where it is checked in, from vsup/config/schema.py:
vsup/config/data/vsup.yaml (configs/vsup.yaml links to it; the wheel ships it) and the README's
"Configuration reference" block, and docs/tune.md's `vsup config --tune-settings` block. Run it after changing a key, a default or a description:

    .venv/bin/python scripts/config_reference.py

tests/test_example_config.py and tests/test_readme.py fail until the two files match the model."""

from __future__ import annotations

from pathlib import Path

from vsup.config.example import example_yaml, with_readme_reference, with_tune_settings

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    example = ROOT / "vsup" / "config" / "data" / "vsup.yaml"
    readme = ROOT / "README.md"
    tune = ROOT / "docs" / "tune.md"
    for path, text in ((example, example_yaml()), (readme, with_readme_reference(readme.read_text())),
                       (tune, with_tune_settings(tune.read_text()))):
        if path.read_text() != text:
            path.write_text(text)
            print(f"{path.relative_to(ROOT)}: rewritten")
        else:
            print(f"{path.relative_to(ROOT)}: already up to date")


if __name__ == "__main__":
    main()
