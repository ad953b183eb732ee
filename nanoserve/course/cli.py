"""`nanoserve course ...` (also `python -m nanoserve.course ...`): the learner's commands.

    nanoserve course start --week 3            # make workspace/ with weeks 3.. stubbed out
    nanoserve course check --week 3            # week 3's tests on your workspace, exercise by exercise
    nanoserve course check --exercise sample   # one exercise's own tests
    nanoserve course check                     # every week, one line each (minutes: it says how many)
    nanoserve course peek rmsnorm              # the reference solution of one exercise
    nanoserve course reset --week 3            # put week 3's stubs back (asks first; --yes does not)
    nanoserve course notebook --week 3         # open week 3's notebook on your workspace

How workspaces are made: nanoserve/course/workspace.py; how they are checked: check.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanoserve.course import check as checking
from nanoserve.course.workspace import (
    DEFAULT_WORKSPACE,
    all_exercises,
    find_exercise,
    make_workspace,
    open_notebook,
    peek,
    reset_exercises,
    week_keys,
    written_exercises,
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanoserve course", description="take the course: stubs, checks, hints")
    ap.add_argument("--workspace", type=Path, default=DEFAULT_WORKSPACE)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("start", help="create or update the workspace, stubbed from --week on")
    p.add_argument("--week", type=int, required=True)
    p = sub.add_parser("check", help="run a week's tests (or one exercise's) on the workspace; all weeks if neither")
    p.add_argument("--week", type=int)
    p.add_argument("--exercise", metavar="NAME", help="run this exercise's own tests only")
    p = sub.add_parser("peek", help="show the reference solution of one exercise")
    p.add_argument("exercise")
    p = sub.add_parser("reset", help="put the stubs of a week (or one exercise) back, discarding your code there")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--week", type=int)
    group.add_argument("--exercise", metavar="NAME")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask before discarding your code")
    sub.add_parser("list", help="list every exercise")
    p = sub.add_parser("notebook", help="open a week's notebook in JupyterLab, on the workspace",
                       description="Any other option goes to JupyterLab, e.g. --port 8890.")
    p.add_argument("--week", type=int, required=True)
    p.add_argument("--no-browser", action="store_true",
                   help="start the server without opening a browser, and print its address (headless, ssh)")
    p.add_argument("--dry-run", action="store_true", help="print the command and its environment, run nothing")
    p.add_argument("--workspace", type=Path, default=argparse.SUPPRESS,
                   help="the workspace to use (default: workspace/ in the repository)")
    return ap


def one_exercise(name: str, week: int | None) -> tuple[int, str] | None:
    """(week, name) of the exercise `name` (of `week`, if given), or None after saying why not."""
    try:
        every = find_exercise(name)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return None
    found = [e for e in every if week is None or e.week == week]
    if not found:
        print(f"{name!r} is not an exercise of week {week}: it is {', '.join(e.key for e in every)}", file=sys.stderr)
        return None
    if len(found) > 1:
        print(f"{name!r} names several exercises ({', '.join(e.key for e in found)}): give its week, as in "
              f"`--exercise {found[0].key}`", file=sys.stderr)
        return None
    return found[0].week, found[0].name


def cmd_check(args: argparse.Namespace) -> int:
    if args.exercise is not None:
        found = one_exercise(args.exercise, args.week)
        if found is None:
            return 2
        return 0 if checking.check_exercise(*found, args.workspace) else 1
    if args.week is None:
        return 0 if checking.progress(args.workspace) else 1
    if not checking.known_week(args.week):
        return 2
    return 0 if checking.check(args.week, args.workspace) else 1


def cmd_reset(args: argparse.Namespace) -> int:
    """Put stubs back, after asking when that discards code the learner wrote. Without a
    terminal to ask on (a script, a pipe), only `--yes` discards anything."""
    if args.exercise is not None:
        found = one_exercise(args.exercise, None)
        if found is None:
            return 2
        keys, what = {f"week{found[0]:02d}:{found[1]}"}, f"exercise '{found[1]}'"
    else:
        if not checking.known_week(args.week):
            return 2
        keys, what = week_keys(args.week), f"week {args.week}"
    mine = written_exercises(keys, args.workspace)
    if mine and not args.yes:
        names = ", ".join(key.split(":")[1] for key in mine)
        if not sys.stdin.isatty():
            print(f"`reset` would discard your code of {len(mine)} exercise(s) of {what} ({names}) and there is no "
                  "terminal to ask on: add --yes to discard it", file=sys.stderr)
            return 2
        answer = input(f"Discard your code of {len(mine)} exercise(s) of {what} ({names}) in "
                       f"{args.workspace / 'nanoserve'}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing reset")
            return 1
    n = reset_exercises(keys, args.workspace)
    print(f"restored {n} stub(s) of {what} in {args.workspace / 'nanoserve'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, jupyter_args = ap.parse_known_args(argv)
    if jupyter_args and args.command != "notebook":
        ap.error(f"unrecognized arguments: {' '.join(jupyter_args)}")

    if args.command == "start":
        if args.week != checking.last_week() + 1 and not checking.known_week(args.week):  # last + 1: all solved
            return 2
        target = make_workspace(args.week, args.workspace)
        stubbed = [e.key for e in all_exercises() if e.week >= args.week]
        print(f"workspace ready: {target}  ({len(stubbed)} exercises to write, weeks {args.week}+)")
        print(f"Edit the files there, then: {checking.course_command(f'check --week {args.week}')}")
        return 0
    if args.command == "check":
        return cmd_check(args)
    if args.command == "peek":
        try:
            print(peek(args.exercise), end="")
        except KeyError as e:
            print(e.args[0], file=sys.stderr)
            return 2
        return 0
    if args.command == "reset":
        return cmd_reset(args)
    if args.command == "notebook":
        return open_notebook(args.week, args.workspace, args.no_browser, args.dry_run, jupyter_args)
    for ex in all_exercises():
        print(f"{ex.key:<40} nanoserve/{ex.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
