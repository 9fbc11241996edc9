"""``python -m services.reaper``"""

from services.reaper import app
from shared import service

if __name__ == "__main__":
    service.main("reaper", app.build)
