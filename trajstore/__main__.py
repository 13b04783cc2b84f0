"""``python -m trajstore``: the command line.

Python put the working folder first on the path; a ``store/`` or ``api/`` package of the
user's there must not replace trajstore's (``trajstore.launch``), so it goes before anything
else is imported.
"""

from trajstore.launch import drop_working_folder

drop_working_folder()

from trajstore.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
