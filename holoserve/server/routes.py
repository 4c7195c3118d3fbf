"""The HTTP routes: thin handlers that hand the parsed request to the app's `ClassifierService`.

Handlers return response models and FastAPI serializes them (straight to JSON bytes in pydantic's
core), so what is sent is what the OpenAPI document declares.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .metrics import CONTENT_TYPE
from .protocol import ErrorResponse, ModelList, PredictRequest, PredictResponse, Status
from .service import ClassifierService

_ERRORS = {c: {"model": ErrorResponse} for c in (400, 401, 413, 422, 500, 503)}


def service(request: Request) -> ClassifierService:
    return request.app.state.service


predict_router = APIRouter()


@predict_router.post("/predict", response_model=PredictResponse, responses=_ERRORS,
                     summary="Classify one text, several texts, or text pairs")
async def predict(req: PredictRequest, request: Request) -> PredictResponse:
    state = request.state
    resp = await service(request).predict(req, state.request_id)
    state.timing = resp.timing_ms  # the access log line carries it too
    return resp


health_router = APIRouter()


@health_router.get("/healthz", response_model=Status, summary="Liveness: the process is up")
async def healthz() -> Status:
    return Status(status="ok")


@health_router.get("/readyz", response_model=Status, responses={503: {"model": Status}},
                   summary="Readiness: the model is loaded and warmed up")
async def readyz(request: Request, response: Response) -> Status:
    status = service(request).readiness()
    if status.status != "ready":
        response.status_code = 503
    return status


models_router = APIRouter()


@models_router.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}},
                   summary="The served model: task, labels, sparsity, precision, backend, dev metrics")
async def models(request: Request) -> ModelList:
    return ModelList(models=[service(request).model_info()])


metrics_router = APIRouter()


@metrics_router.get("/metrics", summary="Prometheus metrics", responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, 401: {"model": ErrorResponse}})
async def metrics(request: Request) -> Response:
    return Response(service(request).metrics.render(), media_type=CONTENT_TYPE)


from .kserve import v2_router  # noqa: E402 - the Open Inference Protocol (KServe v2) routes

ROUTERS = (predict_router, health_router, models_router, metrics_router, v2_router)
