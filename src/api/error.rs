//! API errors: [`ApiError`] maps each failure to its HTTP status and the JSON body
//! `{"error": "<message>"}` every non-2xx response of the API carries (404 and 405 included,
//! through [`not_found`] and [`method_not_allowed`]).

use axum::Json;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Why a request failed. The `Display` text is the `error` field of the response body.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed; the message names the offending field.
    #[error("{0}")]
    BadRequest(String),
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("no route for {method} {path}")]
    NotFound { method: Method, path: String },
    #[error("method {method} is not allowed for {path}")]
    MethodNotAllowed { method: Method, path: String },
    #[error("engine `{0}` is not in the index")]
    UnknownEngine(String),
    /// The server cannot do this (e.g. a read-only state without a pipeline).
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    pub fn bad_request(msg: impl Into<String>) -> ApiError {
        ApiError::BadRequest(msg.into())
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnknownEngine(_) => StatusCode::NOT_FOUND,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The body of every error response.
#[derive(Serialize)]
pub struct ErrorBody {
    pub error: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status(),
            Json(ErrorBody {
                error: self.to_string(),
            }),
        )
            .into_response()
    }
}

/// Router fallback: no route matches the path.
pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound {
        method,
        path: uri.path().to_string(),
    }
}

/// Method fallback: the path exists but not with this method (axum still sets `Allow`).
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method,
        path: uri.path().to_string(),
    }
}
