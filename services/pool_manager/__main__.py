"""``python -m services.pool_manager``"""

from services.pool_manager import app
from shared import service

if __name__ == "__main__":
    service.main("pool-manager", app.build)
