"""``python -m coati_kto.colossalai_launch ...``: a door kept at its documented path; the launcher itself is
``coati_kto.launch.colossalai``."""

from coati_kto.launch.colossalai import main

if __name__ == "__main__":
    main()
