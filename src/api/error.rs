//! API errors: [`ApiError`] maps each failure to its HTTP status and the JSON body
//! `{"error": "<message>"}` every non-2xx response of the API carries (404 and 405 included,
//! through [`not_found`] and [`method_not_allowed`]). 401s carry a `WWW-Authenticate: Bearer
//! realm="kvindex"` challenge and the overload 503 a `Retry-After`.

use axum::Json;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
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
    /// The route needs a bearer token and the request has none (401 with a `WWW-Authenticate`
    /// challenge).
    #[error("this route needs a bearer token (Authorization: Bearer <token>)")]
    MissingToken,
    /// The request's bearer token is not the configured one (401, `error="invalid_token"`).
    #[error("the bearer token is not valid")]
    InvalidToken,
    /// Refused whatever the credentials (e.g. a mutation from off loopback with no token
    /// configured); the message says what to configure.
    #[error("{0}")]
    Forbidden(String),
    /// `http.max_concurrent_requests` are being served (503 with `Retry-After: 1`).
    #[error("too many requests in flight (limit {limit}); retry shortly")]
    Overloaded { limit: usize },
    /// The request was not answered within `http.request_timeout_ms` (503).
    #[error("the request did not complete within {ms} ms")]
    Timeout { ms: u64 },
}

impl From<kvindex_wire::lookup::BadRequest> for ApiError {
    fn from(e: kvindex_wire::lookup::BadRequest) -> ApiError {
        ApiError::BadRequest(e.0)
    }
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
            ApiError::MissingToken | ApiError::InvalidToken => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::Overloaded { .. } | ApiError::Timeout { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
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
        let mut res = (
            self.status(),
            Json(ErrorBody {
                error: self.to_string(),
            }),
        )
            .into_response();
        let extra = match self {
            ApiError::MissingToken => Some((
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(r#"Bearer realm="kvindex""#),
            )),
            ApiError::InvalidToken => Some((
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(r#"Bearer realm="kvindex", error="invalid_token""#),
            )),
            ApiError::Overloaded { .. } => {
                Some((header::RETRY_AFTER, HeaderValue::from_static("1")))
            }
            _ => None,
        };
        if let Some((name, value)) = extra {
            res.headers_mut().insert(name, value);
        }
        res
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
