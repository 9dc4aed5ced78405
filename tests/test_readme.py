import re

from conftest import ROOT


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    test_commands = [c for c in commands if "pytest" in c]
    assert len(test_commands) == 1
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines == test_commands
