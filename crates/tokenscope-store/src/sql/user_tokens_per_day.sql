SELECT date(created_at / 1000000, 'unixepoch') AS day,
       COUNT(*) AS requests,
       SUM(COALESCE(input_tokens, 0)) AS input_tokens,
       SUM(COALESCE(output_tokens, 0)) AS output_tokens,
       SUM(COALESCE(input_tokens, 0) + COALESCE(output_tokens, 0)) AS total_tokens
FROM llm_inference_log
WHERE user_id = :user_id
  AND created_at >= :now_us - 7 * 86400000000
  AND created_at < :now_us
GROUP BY day
ORDER BY day
