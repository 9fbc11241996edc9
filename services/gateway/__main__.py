"""``python -m services.gateway``"""

from services.gateway import app
from shared import service

if __name__ == "__main__":
    service.main("gateway", app.build)
