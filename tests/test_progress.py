"""Progress on a file or pipe: one line per update (no carriage returns), at most one per mininterval and the
last always; on a terminal, tqdm's bar."""

import io

from dsv41 import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_in_a_file_writes_one_line_per_update():
    out = io.StringIO()
    bar = progress.bar(total=3, desc="prefill", unit="tok", file=out)
    assert isinstance(bar, progress.Lines)
    bar.mininterval = 0
    for _ in range(3):
        bar.update(1)
    bar.set_postfix(loss="1.250")
    bar.write("step 3: held out")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(" (")[0] for line in lines[:3]] == ["prefill: 1/3 tok", "prefill: 2/3 tok", "prefill: 3/3 tok"]
    assert lines[3:] == ["step 3: held out"]  # the last count was printed already: close adds nothing


def test_updates_within_mininterval_are_one_line_and_the_last_always_shows():
    out = io.StringIO()
    bar = progress.Lines(total=100, desc="train", unit="step", file=out, mininterval=3600)
    for _ in range(50):
        bar.update(1)
    bar.set_postfix(loss="0.500")
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["train: 1/100 step", "train: 50/100 step"]
    assert lines[1].endswith(", loss=0.500")


def test_a_disabled_bar_writes_nothing():
    out = io.StringIO()
    bar = progress.bar(total=2, desc="train", unit="step", disable=True, file=out)
    bar.update(2)
    bar.write("text")
    bar.close()
    assert out.getvalue() == ""


def test_a_terminal_gets_tqdm_and_a_rewritten_status_line():
    from tqdm import tqdm

    term = Terminal()
    bar = progress.bar(total=2, desc="prefill", unit="tok", file=term)
    assert isinstance(bar, tqdm)
    bar.close()
    status = progress.Status(term)
    status("prefill 1/2")
    status("prefill 2/2")
    status.close()
    assert term.getvalue().endswith(f"\r{'prefill 1/2':<40}\r{'prefill 2/2':<40}\n")
    piped = io.StringIO()
    status = progress.Status(piped)
    status("prefill 1/2")
    status("prefill 2/2")
    status.close()
    assert piped.getvalue() == "prefill 1/2\nprefill 2/2\n"
