"""The Dockerfile, read as text (no image is built here): NVIDIA's PyTorch base image, the
container's torch kept (nothing installs, upgrades or re-resolves torch), megapipe installed
the way docs/examples.md says, its other runtime dependencies equal to setup.py's, and a non-root
user in effect before CMD.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKER_DOCS = ROOT / "docs" / "examples.md"  # the Docker section


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return result


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def shell_commands(line: str) -> list[list[str]]:
    """A shell line's simple commands as word lists, split at ;, &&, || and | (quotes kept)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in (";", "&&", "||", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [words for words in commands if words]


def pip_installs(steps: list[tuple[str, str]]) -> list[list[str]]:
    """The argument words of every `pip install` in a RUN step."""
    found = []
    for keyword, rest in steps:
        if keyword != "RUN":
            continue
        for words in shell_commands(rest):
            for i in range(len(words) - 1):
                if words[i].endswith("pip") and words[i + 1] == "install":
                    found.append(words[i + 2 :])
                    break
    return found


def requirement_name(word: str) -> str:
    return re.split(r"[<>=!~\[;@ ]", word, maxsplit=1)[0].lower().replace("_", "-")


def setup_install_requires() -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return [ast.literal_eval(element) for element in node.value.elts]
    raise AssertionError("setup.py has no install_requires")


def test_instruction_parser_joins_continuations_and_drops_comments() -> None:
    text = "# c\nFROM a:b\nRUN x \\\n && y\n\n# d\nUSER u\n"
    assert instructions(text) == [("FROM", "a:b"), ("RUN", "x  && y"), ("USER", "u")]


def test_shell_commands_split_at_operators_outside_quotes() -> None:
    line = 'a "x; y" && pip install -c f "n>=1" ; b || c | d'
    assert shell_commands(line) == [
        ["a", "x; y"], ["pip", "install", "-c", "f", "n>=1"], ["b"], ["c"], ["d"]
    ]  # fmt: skip


def test_base_image_is_nvidias_pytorch_container(steps: list[tuple[str, str]]) -> None:
    froms = [rest for keyword, rest in steps if keyword == "FROM"]
    assert len(froms) == 1, froms
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", froms[0]), froms[0]


def test_a_non_root_user_is_in_effect_at_cmd(steps: list[tuple[str, str]]) -> None:
    keywords = [keyword for keyword, _ in steps]
    assert keywords.count("CMD") == 1 and keywords[-1] == "CMD"
    assert "pretrain_gpt.py" in steps[-1][1]
    assert "WORKDIR" in keywords
    users = [i for i, keyword in enumerate(keywords) if keyword == "USER"]
    assert users, "no USER instruction: the container would run as root"
    # ${NAME} in USER is an ARG's default value
    defaults = dict(rest.split("=", 1) for k, rest in steps if k == "ARG" and "=" in rest)
    user = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults[m[1]], steps[users[-1]][1])
    assert user.split(":")[0] not in ("root", "0", ""), steps[users[-1]]
    created = [i for i, (k, rest) in enumerate(steps) if k == "RUN" and "useradd" in rest]
    assert created and created[-1] < users[-1]  # the user exists before it is switched to


def test_nothing_installs_or_upgrades_torch(steps: list[tuple[str, str]]) -> None:
    installs = pip_installs(steps)
    assert installs, "the Dockerfile installs nothing with pip"
    for words in installs:
        named = [requirement_name(w) for w in words if not w.startswith("-")]
        assert not {"torch", "pytorch", "torchvision", "torchaudio"} & set(named), words
        for flag in ("-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I"):
            assert flag not in words, (flag, words)
    assert not any(
        re.search(r"\b(conda|mamba|uv)\b.*\binstall\b", rest) for k, rest in steps if k == "RUN"
    )


def test_megapipe_is_installed_without_dependency_resolution(
    steps: list[tuple[str, str]],
) -> None:
    own = [words for words in pip_installs(steps) if "." in words]
    assert len(own) == 1, pip_installs(steps)
    assert "--no-deps" in own[0]  # setup.py's torch>=2.4 must never reach the resolver
    # The rest of setup.py's runtime dependencies are installed by name, torch excepted, and
    # under the container's constraint file, which pins what the image was built with.
    wanted = {requirement_name(r) for r in setup_install_requires()} - {"torch"}
    others = [words for words in pip_installs(steps) if "." not in words]
    installed = {
        requirement_name(w) for words in others for w in words if not w.startswith("-")
    } - {"/etc/pip/constraint.txt"}
    assert installed == wanted
    assert all("--constraint" in words or "-c" in words for words in others)
    # The build checks that torch's version did not change.
    run_text = " ".join(rest for keyword, rest in steps if keyword == "RUN")
    assert "torch.__version__" in run_text and "test " in run_text


def test_docker_docs_agree_with_the_dockerfile(steps: list[tuple[str, str]]) -> None:
    readme = DOCKER_DOCS.read_text()
    assert "docker build -t megapipe ." in readme
    run = re.search(r"docker run (--gpus all [^\n]*)", readme)
    assert run, "docs/examples.md has no `docker run --gpus all ...`"
    for flag in ("--ipc=host", "--ulimit memlock=-1", "--ulimit stack=67108864", ":/data"):
        assert flag in run[1], flag
    # The docs state the install command; it is the Dockerfile's, word for word.
    stated = re.findall(r"`(pip install [^`]*--no-deps[^`]*)`", readme)
    assert stated, "docs/examples.md does not say how the image installs megapipe"
    own = [words for words in pip_installs(steps) if "." in words]
    for command in stated:
        assert shlex.split(command)[2:] == own[0], (command, own[0])


def test_dockerignore_keeps_history_and_runs_out() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", "runs", "*.egg-info", "**/__pycache__"} <= ignored
    # ... but not what the image needs to install and run megapipe.
    assert not {"megapipe", "setup.py", "pretrain_gpt.py", "examples", "tools"} & ignored
